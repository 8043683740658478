"""The small layers of a decoder block: normalization and the feed-forward network."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minidist.model.config import ModelConfig


class RMSNorm(nn.Module):
    """Root-mean-square normalization (Zhang & Sennrich 2019): x / rms(x) · g, no mean subtraction, no bias."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 even under bf16 autocast: the mean of squares is a reduction over d_model.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


def build_norm(cfg: ModelConfig, dim: int | None = None) -> nn.Module:
    dim = dim or cfg.d_model
    if cfg.norm == "layernorm":
        return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)
    return RMSNorm(dim, eps=cfg.norm_eps)


class SwiGLU(nn.Module):
    """Gated feed-forward (Shazeer 2020, "GLU Variants Improve Transformer"): w2(silu(w1 x) ⊙ w3 x)."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = False) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=bias)  # gate
        self.w3 = nn.Linear(d_model, d_ff, bias=bias)  # up
        self.w2 = nn.Linear(d_ff, d_model, bias=bias)  # down: writes into the residual stream

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GeluMLP(nn.Module):
    """The GPT-2/3 feed-forward: w2(gelu(w1 x))."""

    def __init__(self, d_model: int, d_ff: int, bias: bool = True) -> None:
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=bias)
        self.w2 = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


def build_mlp(cfg: ModelConfig) -> nn.Module:
    if cfg.mlp == "gelu":
        return GeluMLP(cfg.d_model, cfg.d_ff, bias=cfg.bias)
    return SwiGLU(cfg.d_model, cfg.d_ff, bias=cfg.bias)
