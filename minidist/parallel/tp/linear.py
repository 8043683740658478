"""The sharded linear layers of tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", §3).

A linear layer Y = X Aᵀ splits two ways across p ranks:
- column-parallel: A by output rows, so rank r computes Y_r = X A_rᵀ, a slice of Y's features; X must be whole;
- row-parallel: A by input columns, so rank r computes X_r A_rᵀ, a partial sum; Y = Σ_r X_r A_rᵀ.
Each shard is a slice of the full value the model was built with and records it (`param.placement`).

Both call the blocks' one linear entry point (`minidist.model.fp8_linear.linear`) with the recipe of the layer they
replace (`Fp8Linear.fp8`, None for a high-precision layer), so FP8 survives sharding; the scaling groups that
cross the split take their maxima over the tp ranks (`TpScales`), and every rank uses the unsharded layer's scales.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minidist.comm.communicator import Comm
from minidist.model.fp8_linear import TpScales, linear
from minidist.parallel.placement import Split, narrow, set_split
from minidist.parallel.tp.operators import reduce_from_tp, sum_grad_over_tp
from minidist.parallel.tp.sequence import reduce_scatter_sequence


def shard_parameter(param: nn.Parameter | None, split: Split) -> nn.Parameter | None:
    """A new Parameter holding this rank's slice (a copy: the full tensor can be freed), with its placement."""
    if param is None:
        return None
    shard = nn.Parameter(narrow(param.detach(), split).clone(), requires_grad=param.requires_grad)
    set_split(shard, "tp", split, param.shape)
    return shard


def max_over_tp(comm: Comm) -> Callable[[torch.Tensor], torch.Tensor]:
    """FP8 scaling maxima of a sharded linear, reduced over the tp group (MAX all-reduce, in place)."""

    def reduce_max(t: torch.Tensor) -> torch.Tensor:
        comm.all_reduce(t, op="max")
        return t

    return reduce_max


class ColumnParallelLinear(nn.Linear):
    """A slice of a linear's output features (weight and bias split by rows). No communication of its own: the
    input reaches it through the region's entry (f, or an all-gather along the sequence); under FP8 the scales
    that span the output features (tensorwise W and dY, rowwise dY and Wᵀ) take a MAX over `comm`."""

    def __init__(self, full: nn.Linear, split: Split, comm: Comm | None = None) -> None:
        nn.Module.__init__(self)  # skip nn.Linear's allocation; the parameters are slices of `full`
        self.weight = shard_parameter(full.weight, split)
        self.bias = shard_parameter(full.bias, split)
        self.out_features, self.in_features = self.weight.shape
        self.fp8 = getattr(full, "fp8", None)
        self.fp8_tp = TpScales(max_over_tp(comm), "N") if self.fp8 is not None and comm is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.fp8, self.fp8_tp)


class RowParallelLinear(nn.Linear):
    """A slice of a linear's input features: partial sums, reduced by g (or a reduce-scatter along the sequence);
    the bias (replicated) is added once, after the reduction."""

    def __init__(self, full: nn.Linear, rank: int, size: int, comm: Comm, sequence_parallel: bool,
                 reduce_dtype: torch.dtype | None) -> None:
        nn.Module.__init__(self)
        self.weight = shard_parameter(full.weight, Split(dim=1, index=rank, parts=size, replicas=1))
        self.bias = shard_parameter(full.bias, Split(dim=None, index=0, parts=1, replicas=size))
        self.out_features, self.in_features = self.weight.shape
        self.comm, self.sequence_parallel, self.reduce_dtype = comm, sequence_parallel, reduce_dtype
        self.fp8 = getattr(full, "fp8", None)
        self.fp8_tp = TpScales(max_over_tp(comm), "K") if self.fp8 is not None else None
        if self.bias is not None and sequence_parallel:
            sum_grad_over_tp(self.bias, comm)  # added on a sequence shard only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial_sums = linear(x, self.weight, None, self.fp8, self.fp8_tp)
        reduce = reduce_scatter_sequence if self.sequence_parallel else reduce_from_tp
        y = reduce(partial_sums, self.comm, self.reduce_dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)
