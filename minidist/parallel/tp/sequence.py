"""Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
§4.2): the activations outside the tensor-parallel regions (norms, residual adds) are split along the sequence, and
f/g become all-gather / reduce-scatter along the sequence, in both directions. The same bytes as f/g (all-reduce =
reduce-scatter + all-gather), and p times less activation memory outside the regions.

Activations are [batch, seq, ...]; each rank holds seq/p consecutive positions. `gather_whole_sequence` and
`slice_sequence` let a layer that needs the whole sequence (an MoE layer: capacity and balance loss are per sequence)
run on it inside a sequence-parallel model.
"""

from __future__ import annotations

import torch

from minidist.comm.communicator import Comm


# Comm gathers and scatters along dim 0; the sequence is dim 1 of [batch, seq, ...]. The results are made contiguous
# again: a transposed view would make each linear that reads it save its own contiguous copy for the backward pass.
def _gather_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return comm.all_gather(x.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, comm: Comm, reduce_dtype: torch.dtype | None) -> torch.Tensor:
    y = x.transpose(0, 1).to(reduce_dtype or x.dtype, memory_format=torch.contiguous_format)
    return comm.reduce_scatter(y).transpose(0, 1).to(x.dtype, memory_format=torch.contiguous_format)


def _slice_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x.narrow(1, comm.rank * (x.shape[1] // comm.size), x.shape[1] // comm.size).contiguous()


class _GatherSequence(torch.autograd.Function):  # Korthikanti's g: all-gather forward, reduce-scatter backward
    @staticmethod
    def forward(ctx, x, comm, reduce_dtype):
        ctx.comm, ctx.reduce_dtype = comm, reduce_dtype
        return _gather_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.comm, ctx.reduce_dtype), None, None


class _ReduceScatterSequence(torch.autograd.Function):  # Korthikanti's ḡ: reduce-scatter forward, all-gather back
    @staticmethod
    def forward(ctx, x, comm, reduce_dtype):
        ctx.comm = comm
        return _reduce_scatter_seq(x, comm, reduce_dtype)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.comm), None, None


class _GatherOrSlice(torch.autograd.Function):
    """All-gather of the sequence, or this rank's slice of a sequence every rank holds whole: each is the other's
    backward (around a layer every rank runs whole, every rank holds the same gradient, so a slice of it is this
    rank's share)."""

    @staticmethod
    def forward(ctx, x, comm, gather: bool):
        ctx.comm, ctx.gather = comm, gather
        return _gather_seq(x, comm) if gather else _slice_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return (_slice_seq(grad, ctx.comm) if ctx.gather else _gather_seq(grad, ctx.comm)), None, None


def gather_sequence(x: torch.Tensor, comm: Comm, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, T/p, ...] -> [B, T, ...]: all-gather along the sequence forward; reduce-scatter of the gradient back."""
    return _GatherSequence.apply(x, comm, reduce_dtype)


def reduce_scatter_sequence(x: torch.Tensor, comm: Comm, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, T, ...] partial sums -> [B, T/p, ...] summed: reduce-scatter forward; all-gather of the gradient back."""
    return _ReduceScatterSequence.apply(x, comm, reduce_dtype)


def gather_whole_sequence(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[B, T/p, ...] -> [B, T, ...] for a layer every rank runs whole; backward: this rank's slice of the gradient
    (every rank holds the same one)."""
    return _GatherOrSlice.apply(x, comm, True)


def slice_sequence(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """[B, T, ...] the same on every rank -> this rank's [B, T/p, ...]; backward: all-gather of the gradient."""
    return _GatherOrSlice.apply(x, comm, False)
