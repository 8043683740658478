"""Chapter 04 exercises, answered: Llama 3.1's by-parts frequencies, dynamic NTK scaling, and YaRN's temperature
where only part of each head is rotated (MLA)."""

import math

import torch


def _rope_frequencies(head_dim: int, base: float) -> torch.Tensor:
    return base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def llama3_frequencies(head_dim: int, base: float, factor: float, original_max_position: int,
                       low_freq_factor: float = 1.0, high_freq_factor: float = 4.0) -> torch.Tensor:
    """Llama 3.1's `rope_type="llama3"` frequencies (see exercises/ch04_context.py)."""
    theta = _rope_frequencies(head_dim, base)
    wavelength = 2 * math.pi / theta
    keep_below = original_max_position / high_freq_factor  # short wavelengths: many turns in the context, keep
    interpolate_above = original_max_position / low_freq_factor  # long wavelengths: under a turn, interpolate
    # In between, blend on the number of turns in the context, L / λ: 0 at low_freq_factor, 1 at high_freq_factor.
    smooth = (original_max_position / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * theta / factor + smooth * theta
    result = torch.where(wavelength > interpolate_above, theta / factor, blended)
    return torch.where(wavelength < keep_below, theta, result)


def dynamic_ntk_frequencies(head_dim: int, base: float, original_max_position: int, seq_len: int) -> torch.Tensor:
    """NTK-aware frequencies for the current length (see exercises/ch04_context.py)."""
    factor = max(1.0, seq_len / original_max_position)  # no stretching until the context is exceeded
    return _rope_frequencies(head_dim, base * factor ** (head_dim / (head_dim - 2)))


def mla_yarn_softmax_scale(qk_nope_head_dim: int, qk_rope_head_dim: int, factor: float) -> float:
    """The softmax scale of MLA under YaRN (see exercises/ch04_context.py)."""
    # √(1/t) would multiply q and k; only the rope part of them is rotated, so the whole 1/t goes on the logits.
    one_over_t = (0.1 * math.log(factor) + 1.0) ** 2
    return one_over_t / math.sqrt(qk_nope_head_dim + qk_rope_head_dim)
