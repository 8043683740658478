"""Build one rank's part of a model without ever holding the whole model (memory that scales).

The model is constructed on the meta device (shapes, no storage), tensor parallelism is applied there (it only
slices and swaps modules: nothing communicates during construction), and only then are this rank's tensors
allocated and filled, one parameter at a time: the full initial value of that parameter is drawn from
(seed, name) exactly as `minidist.model.init.init_value` draws it, this rank's slice is copied out, and the full tensor
is freed before the next. So the law of chapter 02 holds unchanged (a shard is a slice of the value a function of
(seed, name) gives, whatever tp is), and at most 1/tp of the sharded parameters plus one full parameter in transit
are resident. Drawing still costs the full model's random numbers on every rank (the generator cannot skip ahead);
memory, not time, is what this saves.

The trainer builds every rank this way: `meta_model` is the structure, `parallelize(..., materialize=
materializer(cfg, seed, device))` transforms it on the meta device (tensor parallel slices, expert parallel keeps
this rank's experts, pipeline parallel this stage's blocks, embedding and head) and only then fills what is left.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from minidist.model import ModelConfig, Transformer
from minidist.model.init import init_value
from minidist.model.transformer import RotaryEmbedding
from minidist.parallel.placement import narrow, placement_of

ZERO_BUFFERS = ("router_bias", "tokens_per_expert", "step_sums")  # MoE's bias and counts start at zero


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
        torch.utils.swap_tensors(param, real)  # same object (module references stay), this rank's data
        param.__dict__.update(attributes)
        hooks, param._backward_hooks = param._backward_hooks, None  # tensor parallel's gradient hooks: the
        param._backward_hooks = hooks  # dict moved with __dict__, setting it registers them on the new data
    for name, module in list(model.named_modules()):
        if isinstance(module, RotaryEmbedding):  # buffers computed at construction: compute them again here
            with torch.device("cpu"):  # from the formula on the host, as at construction: the same bits anywhere
                model.set_submodule(name, RotaryEmbedding(cfg).to(device))
        for key, buffer in list(module.named_buffers(recurse=False)):
            if buffer.is_meta and key in ZERO_BUFFERS:
                setattr(module, key, torch.zeros_like(buffer, device=device))
    meta = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if meta:
        raise ValueError(f"cannot materialize buffers {meta} of a meta-device model (no rule to compute them)")
    return model


def meta_model(cfg: ModelConfig) -> Transformer:
    """`Transformer(cfg)` on the meta device: names, shapes and modules, no storage (values come in `materialize`)."""
    with torch.device("meta"):
        return Transformer(cfg)


def materializer(cfg: ModelConfig, seed: int, device: str | torch.device) -> Callable[[nn.Module], nn.Module]:
    """What `parallelize` calls once the layout transformations have kept this rank's part of a `meta_model`."""
    return functools.partial(materialize, cfg=cfg, seed=seed, device=device)
