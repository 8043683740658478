"""A parameter's `Placement` (parallel/placement.py) as DTensor placements, and a `redistribute` as the collective
chapter 00 built, with its bytes.

DTensor (torch.distributed.tensor) describes a tensor on a `DeviceMesh` by one placement per mesh dimension:

    Shard(d)     the ranks of that dimension hold equal slices of dim d   minidist: Split(d, i, n, 1)
    Replicate()  every rank of that dimension holds the whole           minidist: replicated_over, or no split
    Partial()    every rank holds a summand of the value (a gradient before it is reduced over its replicas)

Two minidist records have no DTensor form, said in one line by `dtensor_placements`: a slice copied on several
ranks of one group (a kv head shared by tp ranks when kv heads < tp: `Split.replicas` > 1), and ZeRO's flat ranges
(not rectangles: FSDP2 shards each parameter along dim 0 instead). A pipeline stage is not a placement either:
torchtitan, like minidist, keeps pp outside the SPMD mesh (a stage's parameters live on the submesh of its ranks).

`redistribute` from one placement to another runs one collective, the one chapter 00 derived:

    Shard -> Replicate      all_gather         Partial -> Replicate   all_reduce
    Partial -> Shard        reduce_scatter     Shard(i) -> Shard(j)   all_to_all (NCCL); all_gather + slice on gloo
    Replicate -> Shard      none: each rank keeps its slice            Replicate -> Partial   none

`redistribute_bytes` prices a move by the formula `Comm`'s ledger uses (`comm.communicator.ring_bytes_sent`);
`CollectiveShapes` records what DTensor actually sends. These comparisons are the one place in the package where
bytes move outside `Comm`, on purpose: they measure torch's own collectives against the ledger's formulas.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minidist.comm.communicator import ring_bytes_sent
from minidist.parallel.placement import Placement, Split

# (source kind, target kind) -> the collective DTensor runs on a NCCL mesh (kinds: "S" shard, "R", "P")
COLLECTIVE = {("S", "R"): "all_gather", ("P", "R"): "all_reduce", ("P", "S"): "reduce_scatter",
              ("S", "S"): "all_to_all", ("R", "S"): None, ("R", "P"): None, ("R", "R"): None, ("P", "P"): None}


def kind(placement: Any) -> str:
    """"S", "R" or "P" for a DTensor placement."""
    if placement.is_shard():
        return "S"
    return "R" if placement.is_replicate() else "P"


def _groups_within(groups: tuple[str, ...]) -> set[str]:
    """The mesh dimensions a tuple of minidist groups covers ("dp_cp" is dp and cp)."""
    return set(groups) | ({"dp", "cp"} if "dp_cp" in groups else set())


def dtensor_placements(placement: Placement, mesh_dims: tuple[str, ...], grad: bool = False) -> tuple:
    """The DTensor placements, one per mesh dimension, of a parameter laid out as `placement` (of its gradient
    before the reduction over its replicas when `grad`: Partial over them)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    out = []
    for name in mesh_dims:
        split = placement.splits.get(name)
        if split is not None and split.dim is not None:
            if split.replicas != 1:
                raise ValueError(f"a slice held by {split.replicas} ranks of {name!r} has no DTensor placement (Shard "
                                 f"needs {split.parts * split.replicas} distinct slices; e.g. kv heads < tp)")
            out.append(Shard(split.dim))
        elif grad and name in _groups_within(placement.replicated_over):
            out.append(Partial())
        else:
            out.append(Replicate())
    return tuple(out)


def placement_of_dtensor(placements: tuple, mesh_dims: tuple[str, ...], coordinate: list[int],
                         mesh_shape: tuple[int, ...], full_shape: tuple[int, ...]) -> Placement:
    """The minidist `Placement` of a DTensor at mesh `coordinate`: a Split per Shard, the Replicate dims as
    `replicated_over`. Partial has no minidist parameter form (a gradient's pending sum)."""
    splits, replicated = {}, []
    for name, p, i, n in zip(mesh_dims, placements, coordinate, mesh_shape):
        if kind(p) == "S":
            if full_shape[p.dim] % n:
                raise ValueError(f"dim {p.dim} of {full_shape} does not split in {n} equal slices over {name!r}")
            splits[name] = Split(p.dim, i, n, 1)
        elif kind(p) == "R":
            replicated.append(name)
        else:
            raise ValueError(f"Partial over {name!r} is a pending sum, not where a parameter lives")
    return Placement(tuple(full_shape), splits, 0, tuple(replicated))


def redistribute_bytes(src: Any, dst: Any, full_shape: tuple[int, ...], element_size: int, p: int, rank: int,
                       device_type: str = "cuda") -> tuple[str | None, int]:
    """(collective, bytes this rank sends) of redistributing a tensor of `full_shape` from `src` to `dst` over one
    mesh dimension of `p` ranks, by the ledger's ring formulas. On gloo a shard-to-shard move is an all-gather of
    the full tensor (DTensor's fallback: the CPU process group has no all-to-all path)."""
    op = COLLECTIVE[(kind(src), kind(dst))]
    if op == "all_to_all":
        if device_type == "cpu":
            return "all_gather", ring_bytes_sent("all_gather", full_shape, element_size, p, rank)
        local = torch.Size(full_shape).numel() // p * element_size
        return op, local - local // p  # every split but the one this rank keeps (Comm.all_to_all's entry)
    if op is None:
        return None, 0
    return op, ring_bytes_sent(op, full_shape, element_size, p, rank)


FUNCTIONAL = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
              "all_reduce": "all_reduce", "all_to_all_single": "all_to_all"}


class CollectiveShapes(TorchDispatchMode):
    """Records each functional collective DTensor issues (torch.ops._c10d_functional): (op as in the ledger, the
    full tensor's shape as `ring_bytes_sent` takes it, element size, group size)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[int, ...], int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in FUNCTIONAL:
            t, op = args[0], FUNCTIONAL[name]
            p = {"all_gather": args[1], "reduce_scatter": args[2]}.get(op, 0)  # the others: the group's size
            shape = (t.shape[0] * p, *t.shape[1:]) if op == "all_gather" else tuple(t.shape)  # the full tensor
            self.calls.append((op, tuple(shape), t.element_size(), p))
        return func(*args, **(kwargs or {}))

    def bytes_sent(self, rank: int, p: int) -> int:
        """What the recorded collectives send from group rank `rank`, by the ledger's formulas."""
        return sum(ring_bytes_sent(op, shape, size, p, rank) for op, shape, size, _ in self.calls
                   if op != "all_to_all")
