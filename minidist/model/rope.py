"""Rotary position embeddings (Su et al. 2021, "RoFormer", eq. 34).

Each pair of dimensions (x_{2i}, x_{2i+1}) of a query or key at position m is rotated by the angle m·θ_i with
θ_i = base^(−2i/d). Two storage layouts exist: "interleaved" pairs adjacent dimensions (the paper, Meta's Llama
code), "half" pairs dimension i with i + d/2 (the `rotate_half` of Hugging Face's Llama). They are the same
rotation up to a fixed permutation of the head dimensions.
"""

from __future__ import annotations

import torch


def rope_frequencies(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """θ_i = base^(−2i/d) for i = 0 .. d/2 − 1 (float32, shape [head_dim // 2])."""
    if head_dim % 2:
        raise ValueError(f"RoPE rotates pairs of dimensions, so head_dim must be even, got {head_dim}")
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)).float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(m·θ_i)·scale and sin(m·θ_i)·scale, each of shape [*positions.shape, head_dim // 2], in float32."""
    angles = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    return torch.cos(angles) * scale, torch.sin(angles) * scale


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotate the last dimension of x ([..., T, head_dim]) by precomputed cos/sin ([T, head_dim // 2])."""
    x32 = x.float()
    if layout == "half":
        x1, x2 = x32.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    elif layout == "interleaved":
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        raise ValueError(f"RoPE layout {layout!r} is unknown; choose 'half' or 'interleaved'")
    return out.to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotate x ([..., T, head_dim]) at integer positions ([T]) with frequencies from `rope_frequencies`."""
    cos, sin = rope_cos_sin(positions, freqs)
    return apply_rotary(x, cos, sin, layout)


def rope_for_config(cfg) -> tuple[torch.Tensor, float]:
    """The frequencies and attention scale a model config asks for (context extension applied)."""
    head_dim = cfg.mla.qk_rope_head_dim if cfg.attention == "mla" else cfg.head_dim
    scaling = cfg.rope_scaling
    if scaling.kind == "none":
        return rope_frequencies(head_dim, cfg.rope_base), 1.0
    raise NotImplementedError(f"rope scaling {scaling.kind!r} arrives with chapter 04")
