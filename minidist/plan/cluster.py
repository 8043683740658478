"""The machine a layout runs on (chapter 12): one chip's peak FLOP/s, memory, memory bandwidth and measured
kernels' rates, in nodes of `gpus_per_node` chips joined by NVLink, with a network across; and where each rate
comes from, in words, for every report to state its sources. The figures are `minidist.hardware`'s datasheet and
benchmark tables."""

from __future__ import annotations

from dataclasses import dataclass

from minidist.hardware import (
    ATTENTION_KERNEL,
    ATTENTION_SOURCE,
    DEEPGEMM_DENSE,
    DEEPGEMM_SOURCE,
    FP8_BLOCKWISE_CHIPS,
    MAMF_SOURCE,
    AttentionKernel,
    Link,
    chip,
    expert_gemm_rate,
    gemm_rate,
    node_chips,
    peak_flops,
)
from minidist.plan.gemm_table import GemmTable

DEFAULT_EFFICIENCY = 0.5  # fraction of the dense peak a large training matmul reaches (MFU ~40% once comm is in)


@dataclass(frozen=True)
class Cluster:
    """The machine a layout runs on: one chip's peak FLOP/s and memory, nodes of `gpus_per_node` chips."""

    name: str
    peak_flops: float
    memory_bytes: float
    gpus_per_node: int
    intra: Link
    inter: Link
    efficiency: float = DEFAULT_EFFICIENCY
    usable_memory: float = 0.9  # of memory_bytes: the rest for the allocator's slack, workspaces, NCCL buffers
    fp8_peak_flops: float = 0.0  # the chip's dense FP8 peak (0: none on record)
    attention_kernel: AttentionKernel | None = None  # its measured rates by length (None: at the matmul rate)
    hbm_bandwidth: float = 0.0  # bytes/s of the chip's memory (0: element-wise kernels not charged)
    sms: int = 0  # the chip's streaming multiprocessors (0: none on record)
    gemm_table: GemmTable | None = None  # bf16 GEMM rates by shape, measured (None: every GEMM at `efficiency`)

    @property
    def budget(self) -> float:
        """Bytes a layout may use per chip."""
        return self.memory_bytes * self.usable_memory


def cluster_for_chip(name: str, gpus_per_node: int = 8, efficiency: float | None = DEFAULT_EFFICIENCY) -> Cluster:
    """A cluster of chip `name` (one of `hardware.node_chips()`), its usual links, one network port per GPU;
    efficiency None: the chip's published matmul efficiency (`hardware.MATMUL_EFFICIENCY`), else the default."""
    if name not in node_chips():
        raise ValueError(f"no link and memory figures for chip {name!r}; choose one of {node_chips()}")
    record = chip(name)
    if efficiency is None:
        efficiency = record.matmul_efficiency or DEFAULT_EFFICIENCY
    return Cluster(name, peak_flops(name), record.memory_bytes, gpus_per_node, record.intra, record.inter, efficiency,
                   fp8_peak_flops=record.dense_peak.get("fp8", 0.0), attention_kernel=ATTENTION_KERNEL.get(name),
                   hbm_bandwidth=record.hbm_bandwidth or 0.0, sms=record.sms or 0)


def attention_source(cluster: Cluster) -> str:
    """Where the attention kernels' rate comes from, in words."""
    if cluster.attention_kernel is None:
        return f"at the matmul rate (no attention kernel measured on {cluster.name})"
    return f"at {ATTENTION_SOURCE}"


def elementwise_source(cluster: Cluster) -> str:
    """How the element-wise kernels are charged (`plan.elementwise`), in words."""
    if not cluster.hbm_bandwidth:
        return f"not charged (no memory bandwidth on record for {cluster.name})"
    return (f"one pass each at the {cluster.hbm_bandwidth / 1e9:,.0f} GB/s of {cluster.name}'s memory (its datasheet; "
            "a lower bound)")


def efficiency_source(cluster: Cluster) -> str:
    """Where the cluster's compute efficiency comes from, in words."""
    published = chip(cluster.name).matmul_efficiency if cluster.name in node_chips() else None
    if published is not None and cluster.efficiency == published:
        words = f"the best bf16 matmul measured on {cluster.name} ({MAMF_SOURCE})"
    else:
        words = "given" if cluster.efficiency != DEFAULT_EFFICIENCY else "the default (no published matmul figure)"
    table = cluster.gemm_table
    if table is None:
        return words
    return (f"{words}; the blocks' bf16 linears at the {table.dtype} GEMM rates by shape measured on {table.device} "
            f"({table.source}: {len(table.rates):,} shapes), a shape outside it at that efficiency")


def fp8_rate(cluster: Cluster, fp8: str, rows_per_expert: float | None = None) -> float:
    """FLOP/s of the blocks' FP8 linears (the routed experts' with `rows_per_expert` rows each): blockwise scaling
    at DeepGEMM's measured rates where they were measured (`hardware.FP8_BLOCKWISE_CHIPS`: the dense linears'
    `DEEPGEMM_DENSE`, the experts' `expert_gemm_rate`), else the FP8 peak (twice bf16's on Hopper) at the bf16
    matmul efficiency. A chip without an FP8 peak on record is a one-line ValueError."""
    if not cluster.fp8_peak_flops:
        raise ValueError(f"--fp8 {fp8}: {cluster.name} has no FP8 peak on record (no FP8 tensor cores, or no "
                         "datasheet FP8 figure in minidist/hardware.py); choose one of "
                         f"{[name for name in node_chips() if 'fp8' in chip(name).dense_peak]}")
    if _deepgemm_measured(cluster, fp8):
        return gemm_rate(DEEPGEMM_DENSE) if rows_per_expert is None else expert_gemm_rate(rows_per_expert)
    return cluster.fp8_peak_flops * cluster.efficiency


def _deepgemm_measured(cluster: Cluster, fp8: str) -> bool:
    """Whether DeepGEMM measured `fp8` on `cluster`'s chip: the blockwise recipe on `FP8_BLOCKWISE_CHIPS`."""
    return fp8 == "blockwise" and cluster.name in FP8_BLOCKWISE_CHIPS


def fp8_source(cluster: Cluster, fp8: str) -> str:
    """Where `fp8_rate` comes from, in words."""
    if _deepgemm_measured(cluster, fp8):
        return (f"dense linears {fp8_rate(cluster, fp8) / 1e12:,.0f} TFLOP/s, routed experts by rows per expert "
                f"({fp8_rate(cluster, fp8, 1024) / 1e12:,.0f} at 1,024, {fp8_rate(cluster, fp8, 8192) / 1e12:,.0f} "
                f"at 8,192): {DEEPGEMM_SOURCE}")
    return f"the {cluster.fp8_peak_flops / 1e12:,.0f} TFLOP/s FP8 peak at the bf16 matmul efficiency"
