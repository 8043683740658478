"""The conjugate operators of tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", §3), as autograd functions.

    f: identity forward, all-reduce backward   (enters a region: each rank's input-gradient is a partial sum)
    g: all-reduce forward, identity backward   (leaves a region: sums the partial outputs)

and f applied to a parameter: a gradient hook that sums the gradient of a replicated parameter each tp rank used on
different data. reduce_dtype (e.g. torch.float32) sums bf16 partial sums in a wider type: upcast, reduce, downcast;
twice the bytes, but the error no longer grows with the number of ranks (notebook 08). The sequence-parallel forms
are in `minidist.parallel.tp.sequence`.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.comm.communicator import Comm
from minidist.parallel.placement import placement_of


def all_reduce_copy(x: torch.Tensor, comm: Comm, reduce_dtype: torch.dtype | None) -> torch.Tensor:
    """The sum of `x` over the ranks of `comm`, reduced in `reduce_dtype` (default x's), into a new tensor."""
    y = x.to(reduce_dtype or x.dtype, memory_format=torch.contiguous_format, copy=True)
    comm.all_reduce(y)
    return y.to(x.dtype)


class _CopyToTP(torch.autograd.Function):  # f
    @staticmethod
    def forward(ctx, x, comm, reduce_dtype):
        ctx.comm, ctx.reduce_dtype = comm, reduce_dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_copy(grad, ctx.comm, ctx.reduce_dtype), None, None


class _ReduceFromTP(torch.autograd.Function):  # g
    @staticmethod
    def forward(ctx, x, comm, reduce_dtype):
        return all_reduce_copy(x, comm, reduce_dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def copy_to_tp(x: torch.Tensor, comm: Comm, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """f: identity forward; all-reduce of the gradient over tp backward."""
    return _CopyToTP.apply(x, comm, reduce_dtype)


def reduce_from_tp(x: torch.Tensor, comm: Comm, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """g: all-reduce over tp forward (optionally in reduce_dtype); identity backward."""
    return _ReduceFromTP.apply(x, comm, reduce_dtype)


def sum_grad_over_tp(param: nn.Parameter, comm: Comm) -> None:
    """The gradient of a replicated parameter that each rank used on different data is the sum over the ranks."""
    param.register_hook(lambda grad: all_reduce_copy(grad, comm, None))


def sum_grad_over_replicas(param: nn.Parameter, comm: Comm) -> None:
    """Sum the gradient over the tp ranks holding the same slice (replicated kv heads), with one all-reduce over
    the whole tp group: each rank writes its gradient into its slot of a full-size buffer, zeros elsewhere."""
    split = placement_of(param).splits["tp"]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        buffer = grad.new_zeros((split.parts, *grad.shape))
        buffer[split.index] = grad
        comm.all_reduce(buffer)
        return buffer[split.index]

    param.register_hook(hook)
