"""Initialization: the value of every parameter is a pure function of (seed, parameter name) (chapter 02).

That is what makes every parallel layout start from the same model: a rank that holds a shard of a weight
computes the full value from (seed, name) and keeps its slice (`init_shard`), so the numbers never depend on how
many ranks there are, on which rank draws first, or on the global RNG (a shared random stream would).

The default scheme is GPT-2's (Radford et al. 2019, §2.3): weights ~ N(0, σ²) with σ = cfg.init_std (0.02), and
the matrices that write into the residual stream scaled by 1/√(2·n_layers): each block adds two such outputs to
the stream, and the variance of a sum of 2L independent terms is 2L times the variance of one. Norm gains start
at 1, biases at 0. Notebook 02 derives it and compares it with Xavier (Glorot & Bengio 2010) and Kaiming
(He et al. 2015), whose standard deviations `xavier_std` and `kaiming_std` give.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from minidist.model.config import ModelConfig

# Matrices that write into the residual stream: attention output and the feed-forward down-projection.
RESIDUAL_OUTPUT_SUFFIXES = ("attn.wo.weight", "mlp.w2.weight", "mlp.experts.w2", "mlp.shared.w2.weight")


def xavier_std(fan_in: int, fan_out: int, gain: float = 1.0) -> float:
    """Glorot & Bengio 2010, eq. 12/16: Var(w) = 2 / (fan_in + fan_out), a compromise between keeping the forward
    (n_in·Var(w) = 1) and the backward (n_out·Var(w) = 1) variance; for tanh/linear layers."""
    return gain * math.sqrt(2.0 / (fan_in + fan_out))


def kaiming_std(fan_in: int, gain: float = math.sqrt(2.0)) -> float:
    """He et al. 2015, eq. 10: ½·n_in·Var(w) = 1 for ReLU (it zeroes half the signal), so std = √(2/fan_in).
    gain=1 gives LeCun's 1/√fan_in for linear layers."""
    return gain / math.sqrt(fan_in)


def residual_scale(n_layers: int) -> float:
    """GPT-2's factor on residual-output weights: 1/√(2·n_layers) (two residual additions per block)."""
    return 1.0 / math.sqrt(2 * n_layers)


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed derived from (seed, name), stable across processes and Python versions (unlike hash())."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def init_std(name: str, cfg: ModelConfig) -> float | None:
    """The standard deviation of parameter `name`; None for parameters initialized to a constant (norms, biases)."""
    leaf = name.rsplit(".", 1)[-1]
    owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
    if leaf == "bias" or "norm" in owner:
        return None
    if name.endswith(RESIDUAL_OUTPUT_SUFFIXES):
        return cfg.init_std * residual_scale(cfg.n_layers)
    return cfg.init_std


def init_value(name: str, shape: torch.Size | tuple[int, ...], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full initial value (float32, CPU) of parameter `name`: shards are slices of this tensor."""
    std = init_std(name, cfg)
    if std is None:
        leaf = name.rsplit(".", 1)[-1]
        return torch.zeros(shape, device="cpu") if leaf == "bias" else torch.ones(shape, device="cpu")
    generator = torch.Generator().manual_seed(parameter_seed(seed, name))
    return torch.randn(tuple(shape), generator=generator, device="cpu").mul_(std)  # in place: one full tensor at a time


def init_shard(name: str, full_shape: torch.Size | tuple[int, ...], cfg: ModelConfig, seed: int,
               dim: int, rank: int, world_size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous 1/world_size slice along `dim` of the full initial value of `name`.

    The whole tensor is drawn and sliced, so the shard is the same numbers whatever world_size is.
    """
    size = full_shape[dim]
    if world_size < 1 or not 0 <= rank < world_size or size % world_size:
        raise ValueError(f"cannot take shard {rank} of {world_size} of {name} along dim {dim} (size {size}); "
                         f"world_size must divide {size} and 0 <= rank < world_size")
    return init_value(name, full_shape, cfg, seed).chunk(world_size, dim=dim)[rank].contiguous()


@torch.no_grad()
def init_parameters(model: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Give every parameter of a full (unsharded) model its value from `init_value`."""
    for name, param in model.named_parameters():
        param.copy_(init_value(name, param.shape, cfg, seed))
