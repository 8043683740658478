"""Rotary position embeddings (chapter 03) and their context extension (chapter 04).

RoPE (Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary Position Embedding", eq. 34): each pair of
dimensions of a query or key at position m is rotated by the angle m·θ_i with θ_i = base^(−2i/d), i = 0 .. d/2 − 1.
Because rotations compose, q_m · k_n depends on the positions only through m − n.

Two storage layouts exist: "interleaved" pairs adjacent dimensions (2i, 2i+1) (the paper, Meta's Llama code,
GPT-J), "half" pairs dimension i with i + d/2 (`rotate_half`, Hugging Face's Llama, GPT-NeoX). They are the same
rotation up to a fixed permutation of the head dimensions (`interleaved_to_half_permutation`).

Context extension changes the frequencies so that positions beyond the trained context L map onto angles the
model has seen, with s = L' / L the extension factor:
- position interpolation (Chen et al. 2023, "Extending Context Window of Large Language Models via Positional
  Interpolation"): m → m/s, i.e. every θ_i → θ_i / s (`linear_frequencies`);
- NTK-aware scaling (bloc97 2023, reddit r/LocalLLaMA post "NTK-Aware Scaled RoPE"): base → base·s^(d/(d−2)),
  which leaves the fastest pair untouched and divides the slowest one by s (`ntk_frequencies`);
- YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models", §3.2 eqs. 18–19, §3.4):
  NTK-by-parts (keep pairs that turn many times in L, interpolate pairs that turn less than once, ramp between)
  plus an attention temperature √(1/t) = 0.1·ln(s) + 1 applied to both q and k (`yarn_frequencies`).
"""

from __future__ import annotations

import math

import torch

LAYOUTS = ("half", "interleaved")


def _check_head_dim(head_dim: int) -> None:
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"RoPE rotates pairs of dimensions, so head_dim must be even and >= 2, got {head_dim}")


def _check_factor(factor: float) -> None:
    if not factor >= 1.0:  # also rejects NaN
        raise ValueError(f"context extension factor must be >= 1 (it stretches the context), got {factor}")


def _inv_freq64(head_dim: int, base: float) -> torch.Tensor:
    if not base > 1.0:
        raise ValueError(f"RoPE base must be > 1 (θ_i = base^(-2i/d) must fall with i), got {base}")
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))


def rope_frequencies(head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """θ_i = base^(−2i/d) for i = 0 .. d/2 − 1 (float32, shape [head_dim // 2])."""
    _check_head_dim(head_dim)
    return _inv_freq64(head_dim, base).float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0, *,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(m·θ_i)·scale and sin(m·θ_i)·scale, each of shape [*positions.shape, head_dim // 2], in float32.

    The angles are computed in float32 (the model's choice); pass dtype=torch.float64 for exact checks.
    """
    angles = positions.to(dtype)[..., None] * inv_freq.to(positions.device, dtype)
    return torch.cos(angles) * scale, torch.sin(angles) * scale


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) → (−x2, x1) on the two halves of the last dimension: a 90° turn of every (i, i + d/2) pair."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotate the last dimension of x ([..., T, head_dim]) by precomputed cos/sin ([T, head_dim // 2])."""
    # At least float32 (bf16 angles would be far off at large positions); float64 stays float64.
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    cos, sin = cos.to(x32.dtype), sin.to(x32.dtype)
    if layout == "half":
        x1, x2 = x32.chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    elif layout == "interleaved":
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        raise ValueError(f"RoPE layout {layout!r} is unknown; choose one of {LAYOUTS}")
    return out.to(x.dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, layout: str = "half") -> torch.Tensor:
    """Rotate x ([..., T, head_dim]) at positions ([T], may be fractional) with frequencies θ ([head_dim // 2])."""
    if x.shape[-1] != 2 * freqs.shape[-1]:
        raise ValueError(f"x has head_dim {x.shape[-1]} but {freqs.shape[-1]} frequencies; need head_dim // 2 of them")
    cos, sin = rope_cos_sin(positions, freqs, dtype=torch.promote_types(x.dtype, torch.float32))
    return apply_rotary(x, cos, sin, layout)


def interleaved_to_half_permutation(head_dim: int) -> torch.Tensor:
    """Indices p with x_half = x_interleaved[..., p]: even dimensions first, then odd ones.

    Pair i is (2i, 2i+1) in the interleaved layout and (i, i + d/2) in the half layout, so
    rope_half(x[..., p]) == rope_interleaved(x)[..., p]. Applying p to the output rows of W_q and W_k converts a
    checkpoint from one layout to the other without changing any attention score (q·k is invariant when both
    vectors are permuted the same way). The inverse is `torch.argsort(p)`.
    """
    _check_head_dim(head_dim)
    return torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))


# ---------------------------------------------------------------------------------------------------------------
# context extension (chapter 04)


def linear_frequencies(head_dim: int, base: float, factor: float) -> torch.Tensor:
    """Position interpolation: θ_i / s, the same as feeding positions m / s (Chen et al. 2023)."""
    _check_head_dim(head_dim)
    _check_factor(factor)
    return (_inv_freq64(head_dim, base) / factor).float()


def ntk_base(head_dim: int, base: float, factor: float) -> float:
    """NTK-aware base b' = b·s^(d/(d−2)): chosen so the slowest pair i = d/2 − 1 is interpolated exactly by s."""
    _check_head_dim(head_dim)
    _check_factor(factor)
    if head_dim == 2:
        raise ValueError("NTK-aware scaling needs head_dim >= 4 (the exponent d/(d-2) is undefined for d = 2)")
    return base * factor ** (head_dim / (head_dim - 2))


def ntk_frequencies(head_dim: int, base: float, factor: float) -> torch.Tensor:
    """NTK-aware scaled RoPE (bloc97 2023): the ordinary frequencies with base b' = b·s^(d/(d−2))."""
    return _inv_freq64(head_dim, ntk_base(head_dim, base, factor)).float()


def yarn_attention_scale(factor: float) -> float:
    """√(1/t) = 0.1·ln(s) + 1 (YaRN §3.4): the factor applied to both q and k, so logits scale by 1/t."""
    _check_factor(factor)
    return 0.1 * math.log(factor) + 1.0


def yarn_correction_dim(num_rotations: float, head_dim: int, base: float, original_max_position: int) -> float:
    """The pair index i (real-valued) whose wavelength λ_i = 2π·base^(2i/d) fits `num_rotations` times in L.

    Solving L / λ_i = r for i gives i = d·ln(L / (2π r)) / (2·ln base).
    """
    return head_dim * math.log(original_max_position / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_correction_range(head_dim: int, base: float, original_max_position: int, beta_fast: float = 32.0,
                          beta_slow: float = 1.0) -> tuple[int, int]:
    """(low, high): pairs below `low` turn more than beta_fast times in L (kept), above `high` fewer than beta_slow.

    As in the YaRN authors' code and Hugging Face's `_compute_yarn_parameters`: low is floored, high ceiled, and
    both are clamped to [0, head_dim − 1].
    """
    low = math.floor(yarn_correction_dim(beta_fast, head_dim, base, original_max_position))
    high = math.ceil(yarn_correction_dim(beta_slow, head_dim, base, original_max_position))
    return max(low, 0), min(high, head_dim - 1)


def yarn_ramp(low: float, high: float, n: int) -> torch.Tensor:
    """clamp((i − low) / (high − low), 0, 1) for i = 0 .. n − 1 (float64): 0 = keep θ_i, 1 = interpolate θ_i / s."""
    if high == low:
        high = low + 1e-3  # a step instead of a ramp; avoids 0/0
    return ((torch.arange(n, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)


def yarn_frequencies(head_dim: int, base: float, factor: float, original_max_position: int,
                     beta_fast: float = 32.0, beta_slow: float = 1.0) -> tuple[torch.Tensor, float]:
    """YaRN: NTK-by-parts frequencies and the attention scale √(1/t) (Peng et al. 2023, §3.2 eqs. 18–19, §3.4).

    θ'_i = (1 − γ_i)·θ_i / s + γ_i·θ_i with γ_i = 1 − ramp(i) over the pair index between the correction dims
    of beta_fast and beta_slow (the reference implementations' convention; the paper writes the ramp linearly
    in r = L/λ, chapter 04 compares the two). Returns (inv_freq float32 [head_dim // 2], attention_scale).
    """
    _check_head_dim(head_dim)
    _check_factor(factor)
    if original_max_position < 1:
        raise ValueError(f"YaRN needs the original (trained) context length >= 1, got {original_max_position}")
    if not beta_fast > beta_slow > 0:
        raise ValueError(f"YaRN needs beta_fast > beta_slow > 0 (rotations per context), got {beta_fast}, {beta_slow}")
    theta = _inv_freq64(head_dim, base)
    low, high = yarn_correction_range(head_dim, base, original_max_position, beta_fast, beta_slow)
    interpolate = yarn_ramp(low, high, head_dim // 2)
    inv_freq = theta / factor * interpolate + theta * (1.0 - interpolate)
    return inv_freq.float(), yarn_attention_scale(factor)


def rope_for_config(cfg) -> tuple[torch.Tensor, float]:
    """The frequencies and the cos/sin scale a model config asks for (context extension applied).

    For "yarn" the scale is √(1/t) = 0.1·ln(s) + 1; the model multiplies cos and sin by it, which multiplies
    every rotated q and k by it and so every logit q·k by 1/t. MLA rotates only part of q and k, so there the
    scale must go into the softmax scale instead (as DeepSeek-V2 does): for MLA this returns 1.0 and
    `MultiHeadLatentAttention` applies the YaRN scale squared to its softmax scale.
    """
    head_dim = cfg.mla.qk_rope_head_dim if cfg.attention == "mla" else cfg.head_dim
    scaling = cfg.rope_scaling
    if scaling.kind == "none":
        return rope_frequencies(head_dim, cfg.rope_base), 1.0
    if scaling.kind == "linear":
        return linear_frequencies(head_dim, cfg.rope_base, scaling.factor), 1.0
    if scaling.kind == "ntk":
        return ntk_frequencies(head_dim, cfg.rope_base, scaling.factor), 1.0
    if scaling.kind == "yarn":
        inv_freq, scale = yarn_frequencies(head_dim, cfg.rope_base, scaling.factor, scaling.original_max_seq_len,
                                           scaling.beta_fast, scaling.beta_slow)
        return inv_freq, (1.0 if cfg.attention == "mla" else scale)
    raise ValueError(f"rope scaling kind {scaling.kind!r} is unknown; choose one of none, linear, ntk, yarn")
