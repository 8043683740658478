"""Where each rank's shard sits in the full tensor, and what needs all the shards: full tensors and gradient norms.

Every parameter of a tensor-parallel model carries `param.tp_layout` (a `TPLayout`): the full tensor is cut into
`parts` equal slices along `dim` and this rank holds slice `index`; `replicas` ranks of the tp group hold identical
copies (1 for a plain shard, tp for a replicated parameter, tp / n_kv_heads for a replicated key/value head).

A global gradient norm must count every element of the full model once: shards are summed over the ranks, copies
are not. So each rank adds ||grad||² / replicas for each of its gradients and one all-reduce sums over the group.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from minidist.comm import Comm

# ---------------------------------------------------------------------------------------------------------------
# Where each rank's shard sits in the full tensor
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TPLayout:
    """A parameter's place across the tp ranks: the full tensor cut into `parts` slices along `dim` (None: whole),
    this rank holding slice `index`; `replicas` = tp ranks holding identical copies (tp / parts)."""

    dim: int | None
    index: int
    parts: int
    replicas: int

    def holder(self, slice_index: int) -> int:
        """The first tp rank that holds slice `slice_index` (rank r holds slice r // replicas)."""
        return slice_index * self.replicas


def narrow(full: torch.Tensor, layout: TPLayout) -> torch.Tensor:
    """This rank's slice of a full tensor."""
    if layout.dim is None:
        return full
    size = full.shape[layout.dim] // layout.parts
    return full.narrow(layout.dim, layout.index * size, size)


# ---------------------------------------------------------------------------------------------------------------
# Gradient norms, full tensors
# ---------------------------------------------------------------------------------------------------------------


def sharded_grad_norm(pieces: Iterable[tuple[torch.Tensor, int]], comms: Sequence[Comm]) -> torch.Tensor:
    """sqrt(Σ ||piece||² / replicas), the sum taken over this rank's pieces and then over every group in `comms`.

    A piece is (gradient tensor, number of ranks of those groups holding an identical copy). Dividing by the
    replicas counts a replicated gradient once however many ranks hold it; a sharded one has replicas 1. With
    tensor parallelism alone: pieces = each parameter's grad with `tp_layout.replicas`, comms = [tp]. Composed with
    a ZeRO optimizer over dp_cp: pieces = this rank's slices of the gradient shards, comms = [dp_cp, tp].
    """
    pieces = list(pieces)
    device = pieces[0][0].device if pieces else None
    local = torch.zeros((), dtype=torch.float64, device=device)
    for grad, replicas in pieces:
        local += grad.detach().double().pow(2).sum() / replicas
    for comm in comms:
        comm.all_reduce(local)
    return local.sqrt().float()


def tp_grad_norm(model: nn.Module, comm: Comm) -> torch.Tensor:
    """The global L2 norm of the gradients of a tensor-parallel model, identical on all tp ranks: every shard
    counted once, every replicated parameter counted once (not tp times). One all-reduce of a scalar."""
    return sharded_grad_norm(((p.grad, p.tp_layout.replicas) for p in model.parameters() if p.grad is not None),
                             [comm])


def clip_tp_grad_norm_(model: nn.Module, max_norm: float, comm: Comm) -> float:
    """Scale the gradients so the global norm (`tp_grad_norm`) is at most max_norm (0: no clipping); return the norm
    before clipping. Every tp rank scales by the same factor, so replicas stay identical."""
    norm = tp_grad_norm(model, comm)
    if max_norm > 0:
        # clip_grads_with_norm_ takes the parameters (it reads .grad), not the gradient tensors
        torch.nn.utils.clip_grads_with_norm_([p for p in model.parameters() if p.grad is not None], max_norm, norm)
    return norm.item()


def clip_zero_tp_grad_norm_(zero, max_norm: float, tp_comm: Comm) -> float:
    """`ZeroOptimizer.clip_grad_norm` for a tensor-parallel model (ZeRO over dp_cp, tensor parallel over tp).

    ZeRO's own norm sums this tp rank's gradient shards over dp_cp: it misses the other tp ranks' shards and would
    count a tp-replicated parameter tp times. Here each slice of a gradient shard is weighted by its parameter's
    `tp_layout.replicas`, summed over dp_cp and then over tp. Returns the norm before clipping.
    """
    zero.finish_grad_sync()
    if zero.stage == 0:  # plain data parallel: every rank holds its full (tp-sharded) gradients
        return clip_tp_grad_norm_(zero.model, max_norm, tp_comm)
    pieces = []
    for bucket in zero.buckets:
        start, stop = bucket.shard_range(zero.comm.rank, zero.comm.size)
        for param, offset, numel in zip(bucket.params, bucket.offsets, bucket.numels):
            lo, hi = max(offset, start), min(offset + numel, stop)
            if lo < hi:
                pieces.append((bucket.grad_shard[lo - start:hi - start], param.tp_layout.replicas))
    norm = sharded_grad_norm(pieces, [zero.comm, tp_comm])
    if max_norm > 0:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0).to(zero.buckets[0].grad_shard.dtype)
        for bucket in zero.buckets:
            bucket.grad_shard.mul_(coef)
    return norm.item()


def full_tensor(local: torch.Tensor, layout: TPLayout, comm: Comm) -> torch.Tensor:
    """The whole tensor from every tp rank's slice (one all-gather); a replicated tensor is returned as is."""
    if layout.dim is None:
        return local.detach().clone()
    pieces = comm.all_gather(local.detach().movedim(layout.dim, 0).contiguous()).chunk(comm.size)
    whole = torch.cat([pieces[layout.holder(i)] for i in range(layout.parts)])
    return whole.movedim(0, layout.dim)


def gather_full(model: nn.Module, comm: Comm, grads: bool = False) -> dict[str, torch.Tensor]:
    """{name: full parameter (or gradient, with grads=True)} on every tp rank: names as in the plain model."""
    out = {}
    for name, param in model.named_parameters():
        tensor = param.grad if grads else param
        if tensor is not None:
            out[name] = full_tensor(tensor, param.tp_layout, comm)
    return out


@torch.no_grad()
def load_full(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy this rank's slice of every full tensor in `state` (e.g. a single-device checkpoint) into the model."""
    for name, param in model.named_parameters():
        param.copy_(narrow(state[name], param.tp_layout))
