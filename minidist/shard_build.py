"""Build one tensor-parallel rank's shard of a model without ever holding the whole model (memory that scales).

The model is constructed on the meta device (shapes, no storage), tensor parallelism is applied there (it only
slices and swaps modules: nothing communicates during construction), and only then are this rank's tensors
allocated and filled, one parameter at a time: the full initial value of that parameter is drawn from
(seed, name) exactly as `minidist.init.init_value` draws it, this rank's slice is copied out, and the full tensor
is freed before the next. So the law of chapter 02 holds unchanged (a shard is a slice of the value a function of
(seed, name) gives, whatever tp is), and at most 1/tp of the sharded parameters plus one full parameter in transit
are resident. Drawing still costs the full model's random numbers on every rank (the generator cannot skip ahead);
memory, not time, is what this saves.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.init import init_value
from minidist.model import ModelConfig, Transformer
from minidist.model.transformer import RotaryEmbedding
from minidist.parallel.layout import narrow, placement_of
from minidist.parallel.tensor import apply_tensor_parallel


class ConstructionComm:
    """A tp group's rank and size for building a shard without a process group. Any collective is an error:
    construction must not communicate (a real Comm replaces it before the first forward)."""

    def __init__(self, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"need 0 <= rank < size, got rank {rank} of {size}")
        self.rank, self.size, self.ranks, self.name = rank, size, list(range(size)), f"construction tp{size}"

    def __getattr__(self, op: str):
        raise RuntimeError(f"{op}: a ConstructionComm does not communicate (tensor-parallel construction only)")


@torch.no_grad()
def materialize(model: nn.Module, cfg: ModelConfig, seed: int, device: str | torch.device = "cpu") -> nn.Module:
    """Allocate a meta-device (sharded) model on `device`, one parameter at a time, each with its slice of the
    (seed, name) value. The Parameter objects keep their identity, gradient hooks and placements."""
    device = torch.device(device)
    for name, param in model.named_parameters():  # a tied weight is listed once
        placement = placement_of(param)
        full = init_value(name, placement.full_shape, cfg, seed)  # the one full tensor in transit (on the CPU)
        for split in placement.splits.values():
            full = narrow(full, split)
        real = nn.Parameter(full.to(device, copy=True), requires_grad=param.requires_grad)
        del full
        attributes = dict(param.__dict__)  # the placement; swap_tensors swaps __dict__ too
        torch.utils.swap_tensors(param, real)  # same object (hooks stay), this rank's data
        param.__dict__.update(attributes)
    for name, module in list(model.named_modules()):
        if isinstance(module, RotaryEmbedding):  # buffers computed at construction: compute them again here
            model.set_submodule(name, RotaryEmbedding(cfg).to(device))
    meta = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if meta:
        raise ValueError(f"cannot materialize buffers {meta} of a meta-device model (no rule to compute them)")
    return model


def build_tp_shard(cfg: ModelConfig, seed: int, tp_rank: int, tp_size: int,
                   device: str | torch.device = "cpu", comm=None) -> nn.Module:
    """Tensor-parallel rank `tp_rank` of `tp_size`'s shard of `Transformer(cfg)` initialised from `seed`, built
    without the full model. `comm` is the tp group's Comm for training (default: a `ConstructionComm`, enough to
    build and inspect a shard; a forward needs a real one)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_tensor_parallel(model, cfg, comm or ConstructionComm(tp_rank, tp_size))
    return materialize(model, cfg, seed, device)
