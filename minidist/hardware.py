"""The links of real training machines, for predicting compute and communication time (chapters 07-09).

The course runs on CPUs, where the "network" is shared memory; these figures say what the same bytes cost on the
hardware large models train on. A `Link` is one GPU's share of an interconnect: its bandwidth in bytes per second,
**one direction** (a ring all-reduce sends and receives at once, and the α-β model of `minidist.comm.cost_model` charges
the bytes one rank sends), and α, the latency of one message step. Vendors quote NVLink bidirectionally (the sum of
both directions) and network ports in gigabits per second: both are converted below.

The α values are the per-step latencies of NCCL's own cost model for its ring algorithm with the Simple protocol
(NVIDIA/nccl, src/graph/tuning.cc, table `hwLat`, as of commit 01afd20: 3.4 µs over NVLink, 5.7 µs over PCIe,
9.6 µs over the network). They are model inputs of an order of magnitude, not measurements: for messages of
megabytes, β dominates anyway.

Chip peaks are `minidist.flops.PEAK_FLOPS_BF16` (dense bf16), imported, not copied.
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.comm.cost_model import alpha_beta_time
from minidist.flops import PEAK_FLOPS_BF16, peak_flops

__all__ = ["CHIP_LINKS", "CHIP_MEMORY", "LINKS", "MACHINES", "PEAK_FLOPS_BF16", "Link", "Machine", "collective_time",
           "compute_time", "link_of"]

GB = 1e9  # vendors' GB are 10^9 bytes


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
class Machine:
    """A node of `gpus_per_node` chips joined by `intra`, nodes joined by `inter` (one network port per GPU)."""

    chip: str
    gpus_per_node: int
    intra: str
    inter: str

    @property
    def peak_flops(self) -> float:
        return peak_flops(self.chip)


MACHINES: dict[str, Machine] = {
    "dgx-h100": Machine("H100-SXM", 8, "nvlink4", "ib-ndr400"),
    "dgx-a100": Machine("A100", 8, "nvlink3", "ib-hdr200"),
}

# A chip's usual node for the planner (`minidist.plan.search`): its NVLink inside, one network port per GPU across.
# PCIe and NVL cards are paired or bridged, not switched: their ranks beyond a pair talk over PCIe.
CHIP_LINKS: dict[str, tuple[str, str]] = {
    "A100": ("nvlink3", "ib-hdr200"), "H100-SXM": ("nvlink4", "ib-ndr400"), "H100-PCIe": ("pcie5", "ib-ndr400"),
    "H100-NVL": ("pcie5", "ib-ndr400"), "H800": ("nvlink4-h800", "ib-ndr400"), "H200-SXM": ("nvlink4", "ib-ndr400"),
    "H200-NVL": ("pcie5", "ib-ndr400"), "B200": ("nvlink5", "ib-ndr400"),
}

GIB = 2**30
# Memory of one chip in bytes (datasheets: A100 80GB, H100 SXM/PCIe 80GB, H100 NVL 94GB, H800 80GB, H200 141GB,
# B200 180GB per GPU of an HGX B200). HBM is sized in binary units (an "80GB" H100 reports 81,559 MiB).
CHIP_MEMORY: dict[str, float] = {
    "A100": 80 * GIB, "H100-SXM": 80 * GIB, "H100-PCIe": 80 * GIB, "H100-NVL": 94 * GIB, "H800": 80 * GIB,
    "H200-SXM": 141e9, "H200-NVL": 141e9, "B200": 180e9,
}


def link_of(machine: Machine, group_size: int) -> Link:
    """The link that limits a ring over `group_size` consecutive GPUs: NVLink inside a node, the network beyond.

    A ring that leaves the node crosses the network, and each GPU's traffic goes through its own port, so the
    per-GPU network bandwidth bounds it (NCCL's model makes the same choice: `hw = nNodes == 1 ? intra : NET`).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    return LINKS[machine.intra if group_size <= machine.gpus_per_node else machine.inter]


def collective_time(op: str, nbytes: float, p: int, link: Link) -> float:
    """Seconds for collective `op` on `nbytes` over p ranks joined by `link`: α·steps + β·bytes (cost_model)."""
    return alpha_beta_time(op, nbytes, p, link.latency, link.beta)


def compute_time(flops: float, chip: str, mfu: float = 1.0) -> float:
    """Seconds for `flops` on one `chip` running at `mfu` of its dense bf16 peak (1.0: the peak itself)."""
    if not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu}")
    return flops / (peak_flops(chip) * mfu)
