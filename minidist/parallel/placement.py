"""Where every parameter lives, in one record per parameter, and what needs that record: the gradient norm and
full tensors.

A parallelized model is a collection of local tensors. To reason about the whole model (its gradient norm, a replica
hash, a checkpoint that another layout can load, a memory estimate) each local tensor must say which part of which
full tensor it is. `parallelize` attaches that answer to every parameter as `param.placement`:

- `splits`: the groups over which the full tensor is cut into equal slices (tensor parallel: "tp"), each with the
  dimension, this rank's slice and the number of ranks of that group holding a copy of the same slice (a key/value
  head replicated because there are fewer kv heads than tp ranks);
- `stage`: the pipeline stage that holds the parameter (pipeline parallelism partitions whole parameters; a tied
  embedding is the exception: the first and last stages each hold a copy, recorded as a whole-tensor split over the
  "tied" group with 2 replicas, see `minidist.parallel.pp.tied`);
- `replicated_over`: the groups whose ranks all hold the same values (data parallel replicas: "dp_cp").

A rule every reader relies on: a global sum over the model (of squares, for the norm) must count each element of
the full model exactly once. Shards are disjoint, so they are summed over their group; copies are not, so each
copy is weighted by 1 / (number of copies). `grad_norm` is the only gradient norm in the package; every layout
hands it its pieces. A group that lies inside another (`WITHIN`: the "tied" pair of pipeline ends inside pp) counts
its copies whenever the enclosing group is summed over.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from minidist.comm.communicator import Comm

# Groups whose ranks are all ranks of another group: a copy over the first is a copy within the second.
WITHIN = {"tied": "pp"}


@dataclass(frozen=True)
class Split:
    """A full tensor cut into `parts` equal slices along `dim` over one group; this rank holds slice `index`, and
    `replicas` ranks of the group hold each slice (group size = parts · replicas). dim None: the whole tensor, with
    `replicas` = the group size."""

    dim: int | None
    index: int
    parts: int
    replicas: int

    def holder(self, slice_index: int) -> int:
        """The first rank of the group that holds slice `slice_index` (rank r holds slice r // replicas)."""
        return slice_index * self.replicas


def narrow(full: torch.Tensor, split: Split) -> torch.Tensor:
    """This rank's slice of a full tensor."""
    if split.dim is None:
        return full
    size = full.shape[split.dim] // split.parts
    return full.narrow(split.dim, split.index * size, size)


@dataclass(frozen=True)
class Placement:
    """How one parameter of the full model is laid out over the rank grid (see the module docstring)."""

    full_shape: tuple[int, ...]
    splits: dict[str, Split] = field(default_factory=dict)
    stage: int = 0
    replicated_over: tuple[str, ...] = ()

    def offsets(self) -> tuple[int, ...]:
        """Where this rank's slice starts in the full tensor, per dimension."""
        start = [0] * len(self.full_shape)
        for split in self.splits.values():
            if split.dim is not None:
                start[split.dim] += split.index * (self.full_shape[split.dim] // split.parts)
        return tuple(start)

    def copies(self, groups: Iterable[str]) -> int:
        """How many ranks of the given groups hold this same slice (1 for a pure shard)."""
        groups = set(groups)
        count = 1
        for group, split in self.splits.items():
            if group in groups or WITHIN.get(group) in groups:
                count *= split.replicas
        return count

    def with_split(self, group: str, split: Split) -> Placement:
        return Placement(self.full_shape, {**self.splits, group: split}, self.stage, self.replicated_over)


def placement_of(param: torch.Tensor) -> Placement:
    """The record attached by `parallelize` (a plain parameter: whole, on stage 0, replicated nowhere)."""
    placement = getattr(param, "placement", None)
    return placement if placement is not None else Placement(tuple(param.shape))


def set_split(param: nn.Parameter, group: str, split: Split, full_shape: Sequence[int]) -> None:
    """Record that `param` is `split` of a full tensor of `full_shape` over `group`."""
    base = getattr(param, "placement", None) or Placement(tuple(full_shape))
    param.placement = base.with_split(group, split)


# ---------------------------------------------------------------------------------------------------------------
# The gradient norm: one function for every layout
# ---------------------------------------------------------------------------------------------------------------

GradPiece = tuple[torch.Tensor, Placement]


@torch.no_grad()
def grad_norm(pieces: Iterable[GradPiece], comms: dict[str, Comm]) -> torch.Tensor:
    """sqrt(Σ ||piece||² / copies), summed over this rank's pieces and then over every group in `comms`: a 0-d
    float64 tensor on the pieces' device (no host read).

    `pieces` are this rank's gradient tensors (whole gradients, or the slices a ZeRO rank owns) with their
    parameters' placements; `comms` are the groups over which the pieces are disjoint (tp, pp; dp_cp under ZeRO).
    Squares are summed in fp64: with many shards an fp32 sum differs from one device's in the 5th digit. One
    `torch._foreach_norm` per (device, dtype) group, accumulating in fp64, instead of five kernels per piece.
    """
    pieces = list(pieces)
    names = list(comms)
    device = pieces[0][0].device if pieces else None
    groups: dict[tuple, list[torch.Tensor]] = {}  # (device, dtype, copies): one foreach kernel each
    for grad, placement in pieces:
        groups.setdefault((grad.device, grad.dtype, placement.copies(names)), []).append(grad.detach())
    local = torch.zeros((), dtype=torch.float64, device=device)
    for (_, _, copies), grads in groups.items():
        norms = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64))
        local += norms.square().sum().to(local.device) / copies
    for comm in comms.values():
        comm.all_reduce(local)
    return local.sqrt()


@torch.no_grad()
def clip_grad_norm_(pieces: Iterable[GradPiece], max_norm: float, comms: dict[str, Comm]) -> torch.Tensor:
    """Scale every piece in place so the global norm is at most `max_norm` (0: measure only); return the norm
    before clipping, a 0-d float64 tensor on the device (read it when needed: a read waits for the device). The rule
    of torch.nn.utils.clip_grad_norm_: multiply by min(1, max_norm / (norm + 1e-6)). Every rank computes the same
    norm and the same factor, so replicas stay identical."""
    pieces = list(pieces)
    norm = grad_norm(pieces, comms)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        by_dtype: dict[tuple, list[torch.Tensor]] = {}
        for grad, _ in pieces:
            by_dtype.setdefault((grad.device, grad.dtype), []).append(grad)
        for (device, dtype), grads in by_dtype.items():
            torch._foreach_mul_(grads, coef.to(device=device, dtype=dtype))
    return norm


# ---------------------------------------------------------------------------------------------------------------
# Full tensors from slices
# ---------------------------------------------------------------------------------------------------------------


def full_tensor(local: torch.Tensor, split: Split, comm: Comm) -> torch.Tensor:
    """The whole tensor from every rank's slice (one all-gather over the split's group); a whole tensor is returned
    as it is."""
    if split.dim is None:
        return local.detach().clone()
    pieces = comm.all_gather(local.detach().movedim(split.dim, 0).contiguous()).chunk(comm.size)
    whole = torch.cat([pieces[split.holder(i)] for i in range(split.parts)])
    return whole.movedim(0, split.dim)


def gather_full(model: nn.Module, comm: Comm, group: str = "tp", grads: bool = False) -> dict[str, torch.Tensor]:
    """{name: full parameter (or gradient, with grads=True)} on every rank of `group`: names as in the plain model."""
    out = {}
    for name, param in model.named_parameters():
        tensor = param.grad if grads else param
        if tensor is not None:
            split = placement_of(param).splits.get(group, Split(None, 0, 1, comm.size))
            out[name] = full_tensor(tensor, split, comm)
    return out
