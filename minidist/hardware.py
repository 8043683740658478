"""The chips and links of real training machines, for predicting compute and communication time (chapters 01,
07-09, 12).

The course runs on CPUs, where the "network" is shared memory; these figures say what the same bytes cost on the
hardware large models train on. A `Link` is one GPU's share of an interconnect: its bandwidth in bytes per second,
**one direction** (a ring all-reduce sends and receives at once, and the α-β model of `minidist.comm.cost_model` charges
the bytes one rank sends), and α, the latency of one message step. Vendors quote NVLink bidirectionally (the sum of
both directions) and network ports in gigabits per second: both are converted below.

The α values are the per-step latencies of NCCL's own cost model for its ring algorithm with the Simple protocol
(NVIDIA/nccl, src/graph/tuning.cc, table `hwLat`, as of commit 01afd20: 3.4 µs over NVLink, 5.7 µs over PCIe,
9.6 µs over the network). They are model inputs of an order of magnitude, not measurements: for messages of
megabytes, β dominates anyway.

A `Chip` is one record per accelerator: its dense peak FLOP/s (the MFU denominator, `minidist.flops`), its memory,
the links of its usual node, and the name CUDA reports for it. `CHIPS` is the one table of them.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from minidist.comm.cost_model import alpha_beta_time, cost_terms

GB = 1e9  # vendors' GB are 10^9 bytes
GIB = 2**30


@dataclass(frozen=True)
class Link:
    """One GPU's share of an interconnect: bytes per second in one direction, and α in seconds per message step."""

    name: str
    bandwidth: float
    latency: float

    @property
    def beta(self) -> float:
        """Seconds per byte (the β of the α-β model)."""
        return 1.0 / self.bandwidth


LINKS: dict[str, Link] = {
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): "NVLink: 900GB/s" (18 NVLink 4 links, both directions summed).
    "nvlink4": Link("NVLink 4 (H100 SXM, through NVSwitch)", 900 * GB / 2, 3.4e-6),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM): "NVLink: 600GB/s" (12 NVLink 3 links, both directions summed).
    "nvlink3": Link("NVLink 3 (A100 SXM, through NVSwitch)", 600 * GB / 2, 3.4e-6),
    # InfiniBand NDR, 400 Gb/s per port; a DGX H100 has eight single-port ConnectX-7 adapters, one per GPU
    # (NVIDIA DGX H100 User Guide, §1.2.3 "Network Modules", the port-to-GPU table).
    "ib-ndr400": Link("InfiniBand NDR 400 Gb/s per GPU", 400e9 / 8, 9.6e-6),
    # InfiniBand HDR, 200 Gb/s per port; a DGX A100 has eight single-port ConnectX-6 adapters for its compute fabric
    # (NVIDIA DGX A100 datasheet, 2020: "8x Single-Port Mellanox ConnectX-6 VPI 200Gb/s HDR InfiniBand").
    "ib-hdr200": Link("InfiniBand HDR 200 Gb/s per GPU", 200e9 / 8, 9.6e-6),
    # PCIe Gen5 x16: 128 GB/s both directions (H100 datasheet, "PCIe Gen5: 128GB/s"); Gen4 x16: 64 GB/s (A100).
    "pcie5": Link("PCIe Gen5 x16", 128 * GB / 2, 5.7e-6),
    "pcie4": Link("PCIe Gen4 x16", 64 * GB / 2, 5.7e-6),
    # NVIDIA H800 SXM product brief: "NVLink: 400GB/s" (the H100's NVLink cut to 8 links, both directions summed).
    # DeepSeek-V3 (2024) §3.2.2 reports about 160 GB/s achieved over it; the model uses the rated figure.
    "nvlink4-h800": Link("NVLink 4, H800 (8 links, through NVSwitch)", 400 * GB / 2, 3.4e-6),
    # NVIDIA HGX B200 datasheet (2024): "NVLink: 1.8TB/s" per GPU (NVLink 5, both directions summed).
    "nvlink5": Link("NVLink 5 (B200, through NVSwitch)", 1800 * GB / 2, 3.4e-6),
}


@dataclass(frozen=True)
class Chip:
    """One accelerator: its dense (no 2:4 sparsity) peak FLOP/s by dtype, its memory in bytes, the links of its
    usual node (`intra` inside, `inter` across, one network port per GPU), `device_name`, the part of the name
    `torch.cuda.get_device_name` reports that identifies it, its memory's bandwidth and its SMs. A chip the planner
    cannot place in a node (no memory or link figures) leaves those None."""

    name: str
    dense_peak: dict[str, float] = field(hash=False)
    memory_bytes: float | None = None
    intra: Link | None = None
    inter: Link | None = None
    device_name: str | None = None
    hbm_bandwidth: float | None = None  # bytes/s of its memory, from its datasheet (None: none on record)
    sms: int | None = None  # streaming multiprocessors (None: none on record)

    @property
    def matmul_efficiency(self) -> float | None:
        """The fraction of the dense bf16 peak a large matmul reaches on this chip (`MATMUL_EFFICIENCY`), or None."""
        return MATMUL_EFFICIENCY.get(self.name)


# The best bf16 matmul throughput found by a search over shapes, over the datasheet peak: Stas Bekman, "Machine
# Learning Engineering" (github.com/stas00/ml-engineering, compute/accelerator/README.md, table "Maximum Achievable
# Matmul FLOPS", measured with its mamf-finder.py): A100 SXM 267.9 of 312 TFLOP/s (CUDA 12.1), A100 PCIe 256.4 of 312,
# H100 SXM 792.1 of 989 (CUDA 12.1), GH200 821.0 of 989 (CUDA 12.5). A GEMM benchmark, independent of any training
# run the planner is checked against. The H800 has the H100 SXM's compute die (only NVLink is cut): its figure is
# the H100 SXM's; the H200 SXM's is the GH200's (the same Hopper die and HBM3e). Chips without a published figure
# get none (the planner then uses its stated default).
MAMF_SOURCE = ("Bekman, Machine Learning Engineering, 'Maximum Achievable Matmul FLOPS' table "
               "(github.com/stas00/ml-engineering, compute/accelerator)")
MATMUL_EFFICIENCY: dict[str, float] = {"A100": 267.9 / 312, "H100-SXM": 792.1 / 989, "H800": 792.1 / 989,
                                       "H200-SXM": 821.0 / 989}

# FP8 GEMMs with DeepSeek-V3's fine-grained scaling (1x128 tiles of activations, 128x128 blocks of weights) measured
# at DeepSeek-V3's own shapes on H800 (NVCC 12.8): Zhao et al., DeepGEMM (github.com/deepseek-ai/DeepGEMM, README,
# "Performance", February 2025), a GEMM benchmark, not a training run. Its rows with a training-sized M (a
# micro-batch of 4,096 tokens), as (groups, rows per group, N, K, TFLOP/s): a block's dense linears (the latent
# down-projections, the query and key/value up-projections, the output projection, the shared expert's two).
# Their FLOPs over their summed seconds: 1,132 TFLOP/s, 57% of the 1,979 peak, where twice the best bf16 matmul
# would say 1,584 (fine-grained scaling's promotions cost the rest).
DEEPGEMM_SOURCE = "DeepGEMM's FP8 GEMMs at DeepSeek-V3's shapes on H800 (github.com/deepseek-ai/DeepGEMM, README, 2025)"
DEEPGEMM_DENSE: tuple[tuple[int, int, int, int, float], ...] = (
    (1, 4096, 2112, 7168, 1058), (1, 4096, 24576, 1536, 990), (1, 4096, 32768, 512, 590),
    (1, 4096, 7168, 16384, 1358), (1, 4096, 4096, 7168, 1304), (1, 4096, 7168, 2048, 1025))
# The routed experts' grouped GEMMs by rows per expert (the same README: the contiguous layout at 8,192 and 4,096
# rows, the masked one below), as (rows, TFLOP/s of gate and up: N 4,096, K 7,168; of down: N 7,168, K 2,048). A
# micro-batch of 4,096 tokens gives each expert 8,192 rows at EP 64, 1,024 at EP 8: smaller GEMMs, slower ones.
DEEPGEMM_EXPERTS: tuple[tuple[int, float, float], ...] = (
    (256, 932, 815), (512, 1040, 916), (1024, 1233, 925), (4096, 1288, 1093), (8192, 1297, 1099))
FP8_BLOCKWISE_CHIPS = ("H800", "H100-SXM")  # DeepGEMM's figures hold for: the same compute die and clocks (above)


# Attention kernels in training (forward + backward), by sequence length: FlashAttention-2 (Dao 2023, "FlashAttention-2:
# Faster Attention with Better Parallelism and Work Partitioning") as its repository's README charts it
# (github.com/Dao-AILab/flash-attention, assets/flash2_h100_fwd_bwd_benchmark.png and flash2_a100_fwd_bwd_benchmark.png,
# head dimension 128, bf16/fp16, batch x length = 16k tokens, 2,048 hidden; panel (d) with the causal mask, panel (b)
# without: whole tiles, as context parallelism's blocks off the diagonal are; on A100 the 512-token label of (b) is
# hidden by the legend, so that table starts at 1,024), as (length, TFLOP/s). Its FLOPs are the benchmark's own
# (`benchmarks/benchmark_flash_attention.py`): the forward's 4·b·s²·h·d halved under the causal mask, the backward 2.5
# times the forward (it recomputes the scores): 3.5 forwards in all.
# A kernel benchmark, not a training run. The public kernel both published runs could use for their shapes: Llama 3
# trained before FlashAttention-3's first release (July 2024), and FlashAttention-3 took DeepSeek-V3's head dimensions
# (192 for q·k, 128 for p·v) in February 2025 (forward) and April 2025 (backward), after its report. H800 and H200
# SXM have the H100 SXM's compute die, as for the matmuls above.
ATTENTION_SOURCE = ("FlashAttention-2's forward + backward, head dim 128, by sequence length, causal and whole tiles "
                    "(github.com/Dao-AILab/flash-attention, README benchmark charts, 2023)")


@dataclass(frozen=True)
class AttentionKernel:
    """An attention kernel's measured training rate by length: with the causal mask and without one (full tiles)."""

    causal: tuple[tuple[int, float], ...]
    full: tuple[tuple[int, float], ...]


_FA2_H100 = AttentionKernel(causal=((512, 163), (1024, 221), (2048, 265), (4096, 294), (8192, 308), (16384, 328)),
                            full=((512, 248), (1024, 294), (2048, 320), (4096, 326), (8192, 335), (16384, 338)))
ATTENTION_KERNEL: dict[str, AttentionKernel] = {
    "A100": AttentionKernel(causal=((512, 99), (1024, 133), (2048, 155), (4096, 173), (8192, 182), (16384, 189)),
                            full=((1024, 173), (2048, 187), (4096, 196), (8192, 201), (16384, 203))),
    "H100-SXM": _FA2_H100, "H800": _FA2_H100, "H200-SXM": _FA2_H100}
ATTENTION_KERNEL_FLOPS = 3.5  # the kernels' work in forwards: 1 forward + a backward of 2.5 (the scores recomputed)


def log2_interpolate(table: tuple[tuple[float, float], ...], x: float) -> float:
    """The value at `x` of a table of (x, value) rows sorted by x, linear in log2(x) between rows, the end rows'
    values held beyond them."""
    logs = [math.log2(row[0]) for row in table]
    at = min(max(math.log2(max(x, 1.0)), logs[0]), logs[-1])
    hi = max(bisect.bisect_left(logs, at), 1)  # the first row at or above x (the second at the lower end)
    w = (at - logs[hi - 1]) / (logs[hi] - logs[hi - 1])
    return (1 - w) * table[hi - 1][1] + w * table[hi][1]


@functools.cache  # a search asks for the same few lengths hundreds of thousands of times
def attention_rate(kernel: tuple[tuple[int, float], ...], key_len: float) -> float:
    """FLOP/s (the benchmark's count) of an attention kernel of table `kernel` (`AttentionKernel.causal` or `.full`)
    whose queries each meet up to `key_len` keys, interpolated in log2(length) between the table's lengths (its ends
    held beyond them)."""
    return log2_interpolate(kernel, key_len) * 1e12


@functools.cache  # DeepGEMM's dense table, asked for once per layout of a search
def gemm_rate(rows: tuple[tuple[int, int, int, int, float], ...]) -> float:
    """FLOP/s of a set of GEMMs run one after the other: their FLOPs over the sum of their times."""
    flops = [2 * g * m * n * k for g, m, n, k, _ in rows]
    return sum(flops) / sum(f / (tflops * 1e12) for f, (*_, tflops) in zip(flops, rows))


@functools.cache  # a search asks for the same few row counts hundreds of thousands of times
def expert_gemm_rate(rows_per_expert: float) -> float:
    """FLOP/s of DeepSeek-V3's routed experts' FP8 GEMMs with `rows_per_expert` rows each: gate and up (twice the
    down projection's FLOPs) then down, each interpolated in log2(rows) between `DEEPGEMM_EXPERTS`' rows (the
    ends held beyond them)."""
    up, down = (log2_interpolate(tuple((row[0], row[j]) for row in DEEPGEMM_EXPERTS), rows_per_expert) for j in (1, 2))
    return 3e12 / (2 / up + 1 / down)


# Vendors print the sparse peak, twice the dense one. HBM is sized in binary units (an "80GB" H100 reports 81,559
# MiB); the H200's 141 GB and the B200's 180 GB are quoted as decimal. PCIe and NVL cards are paired or bridged, not
# switched: their ranks beyond a pair talk over PCIe. The table is in the order device names are matched: the first
# chip whose `device_name` is part of the reported name wins, so the more specific names ("H100 NVL", "H100 PCIe")
# come before the bare "H100" (the SXM part, e.g. "NVIDIA H100 80GB HBM3").
CHIPS: tuple[Chip, ...] = (
    # NVIDIA A100 Tensor Core GPU datasheet (2020): BF16 Tensor Core 312 TFLOPS (624 with sparsity); SXM and PCIe. 80GB,
    # 2,039 GB/s (SXM; the PCIe card 1,935). 108 SMs (NVIDIA A100 Tensor Core GPU Architecture whitepaper, 2020).
    Chip("A100", {"bf16": 312e12}, 80 * GIB, LINKS["nvlink3"], LINKS["ib-hdr200"], "A100", 2039 * GB, 108),
    # NVIDIA H100 Tensor Core GPU datasheet (2023), H100 NVL (per GPU of the pair): 1,671 TFLOPS with sparsity ->
    # 835 dense (lower clocks, 400 W). 94GB, 3.9TB/s.
    Chip("H100-NVL", {"bf16": 835e12}, 94 * GIB, LINKS["pcie5"], LINKS["ib-ndr400"], "H100 NVL", 3.9e3 * GB),
    # Same datasheet, H100 PCIe: 1,513 TFLOPS with sparsity -> 756 dense. 80GB, 2TB/s.
    Chip("H100-PCIe", {"bf16": 756e12}, 80 * GIB, LINKS["pcie5"], LINKS["ib-ndr400"], "H100 PCIe", 2e3 * GB),
    # Same datasheet, H100 SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity -> 989. 80GB, 3.35TB/s. 132 SMs (NVIDIA
    # H100 Tensor Core GPU Architecture whitepaper, 2022: "132 SMs" in the SXM5 part).
    # FP8 (H100 SXM, H800, H200 SXM datasheets): 3,958 TFLOPS with sparsity -> 1979 dense, twice bf16.
    Chip("H100-SXM", {"bf16": 989e12, "fp8": 1979e12}, 80 * GIB, LINKS["nvlink4"], LINKS["ib-ndr400"], "H100",
         3.35e3 * GB, 132),
    # NVIDIA H800 SXM product brief: the H100 SXM's compute (1,979 TFLOPS sparse bf16) with cut NVLink -> 989. 80GB,
    # 3.35TB/s; "the 132 SMs available in the H800 GPU" (DeepSeek-V3 report, §3.5.1).
    Chip("H800", {"bf16": 989e12, "fp8": 1979e12}, 80 * GIB, LINKS["nvlink4-h800"], LINKS["ib-ndr400"], "H800",
         3.35e3 * GB, 132),
    # NVIDIA H200 Tensor Core GPU datasheet (2024), H200 NVL: 1,671 TFLOPS with sparsity -> 835 dense. 141GB, 4.8TB/s.
    Chip("H200-NVL", {"bf16": 835e12}, 141e9, LINKS["pcie5"], LINKS["ib-ndr400"], "H200 NVL", 4.8e3 * GB),
    # Same datasheet, H200 SXM: BF16 1,979 TFLOPS with sparsity -> 989 dense. 141GB, 4.8TB/s; the H100 SXM's die.
    Chip("H200-SXM", {"bf16": 989e12, "fp8": 1979e12}, 141e9, LINKS["nvlink4"], LINKS["ib-ndr400"], "H200",
         4.8e3 * GB, 132),
    # NVIDIA HGX B200 datasheet (2024): FP16/BF16 Tensor Core 4.5 PFLOPS per GPU with sparsity -> 2.25 dense.
    # 180GB per GPU of an HGX B200, 8TB/s.
    Chip("B200", {"bf16": 2250e12}, 180e9, LINKS["nvlink5"], LINKS["ib-ndr400"], "B200", 8e3 * GB),
    # Google TPU v4: 275 TFLOPS bf16 per chip (Jouppi et al. 2023; the peak PaLM's MFU is measured against).
    Chip("TPUv4", {"bf16": 275e12}),
)


def chip(name: str) -> Chip:
    """The record of chip `name` (a `Chip.name` of `CHIPS`)."""
    for c in CHIPS:
        if c.name == name:
            return c
    raise ValueError(f"no figures for chip {name!r}; known chips: {sorted(c.name for c in CHIPS)} "
                     "(for a CPU, measure matmuls with minidist.flops.measure_matmul_peak)")


def peak_flops(name: str, dtype: str = "bf16") -> float:
    """Dense peak FLOP/s of one chip in `dtype`, from its datasheet. A CPU has none: use `flops.measure_matmul_peak`."""
    record = chip(name)
    if dtype not in record.dense_peak:
        raise ValueError(f"no {dtype} peak for {name!r}; it has {sorted(record.dense_peak)}")
    return record.dense_peak[dtype]


def datasheet_chip(device_name: str) -> str | None:
    """The chip a CUDA device name is (`Chip.name`), or None for a chip we have no datasheet figures for."""
    return next((c.name for c in CHIPS if c.device_name is not None and c.device_name in device_name), None)


def node_chips() -> list[str]:
    """The chips with memory and link figures, which a planner's cluster can be made of (sorted)."""
    return sorted(c.name for c in CHIPS if c.memory_bytes is not None and c.intra is not None)


class Node(Protocol):
    """What decides a group's link: nodes of `gpus_per_node` chips joined by `intra`, nodes joined by `inter`."""

    gpus_per_node: int
    intra: Link
    inter: Link


@dataclass(frozen=True)
class Machine:
    """A node of `gpus_per_node` chips joined by `intra`, nodes joined by `inter` (one network port per GPU)."""

    chip: str
    gpus_per_node: int
    intra: Link
    inter: Link

    @property
    def peak_flops(self) -> float:
        return peak_flops(self.chip)


def machine_of(name: str, gpus_per_node: int = 8) -> Machine:
    """Nodes of `gpus_per_node` chips `name` with the chip's usual links."""
    record = chip(name)
    if record.intra is None or record.inter is None:
        raise ValueError(f"no link figures for chip {name!r}; choose one of {node_chips()}")
    return Machine(name, gpus_per_node, record.intra, record.inter)


MACHINES: dict[str, Machine] = {"dgx-h100": machine_of("H100-SXM"), "dgx-a100": machine_of("A100")}


def link_of(node: Node, group_size: int) -> Link:
    """The link that limits a ring over `group_size` consecutive GPUs: NVLink inside a node, the network beyond.

    A ring that leaves the node crosses the network, and each GPU's traffic goes through its own port, so the
    per-GPU network bandwidth bounds it (NCCL's model makes the same choice: `hw = nNodes == 1 ? intra : NET`).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return node.intra if group_size <= node.gpus_per_node else node.inter


def collective_time(op: str, nbytes: float, p: int, link: Link) -> float:
    """Seconds for collective `op` on `nbytes` over p ranks joined by `link`: α·steps + β·bytes (cost_model)."""
    return alpha_beta_time(op, nbytes, p, link.latency, link.beta)


def ledger_time(totals: Mapping[tuple[str, str], Mapping[str, float]], p: int, link: Link) -> float:
    """Seconds for the traffic of a ledger's totals (`Ledger.totals()`, or a formula of that shape) on one group of p
    ranks joined by `link`: each call pays α per step of its algorithm (`cost_terms`), each byte sent β."""
    return sum(link.latency * cost_terms(op, 1.0, p)[0] * entry["calls"] + link.beta * entry["bytes"]
               for (op, _), entry in totals.items())


def compute_time(flops: float, chip: str, mfu: float = 1.0) -> float:
    """Seconds for `flops` on one `chip` running at `mfu` of its dense bf16 peak (1.0: the peak itself)."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    return flops / (peak_flops(chip) * mfu)
