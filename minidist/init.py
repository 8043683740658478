"""Initialization: the value of every parameter is a pure function of (seed, parameter name).

That is what makes every parallel layout start from the same model: a rank that holds a shard of a weight
computes the full value from (seed, name) and keeps its slice, so the numbers never depend on how many ranks
there are or which rank draws first (a shared RNG stream would).

The default scheme is GPT-2's (Radford et al. 2019, §2.3): weights ~ N(0, σ²) with σ = init_std, and the
matrices that write into the residual stream scaled by 1/√(2·n_layers), because each block adds two such
outputs to the stream and the variance of a sum of 2L independent terms grows with 2L. Chapter 02 derives it.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from minidist.model.config import ModelConfig

# Matrices that write into the residual stream: attention output and the feed-forward down-projection.
RESIDUAL_OUTPUT_SUFFIXES = ("attn.wo.weight", "mlp.w2.weight", "mlp.experts.w2", "mlp.shared.w2.weight")


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from (seed, name), stable across processes and Python versions."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_std(name: str, cfg: ModelConfig) -> float | None:
    """The standard deviation of parameter `name`; None for parameters initialized to a constant."""
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if leaf == "bias" or "norm" in owner:
        return None
    if name.endswith(RESIDUAL_OUTPUT_SUFFIXES):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


def init_value(name: str, shape: torch.Size | tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full initial value (float32, CPU) of parameter `name`: shards are slices of this tensor."""
    std = init_std(name, cfg)
    if std is None:
        leaf = name.rsplit(".", 1)[-1]
        return torch.zeros(shape) if leaf == "bias" else torch.ones(shape)
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.randn(tuple(shape), generator=generator) * std


@torch.no_grad()
def init_parameters(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Give every parameter of a full (unsharded) model its value from `init_value`."""
    for name, param in model.named_parameters():
        param.copy_(init_value(name, param.shape, cfg, seed))
