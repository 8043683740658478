"""Chapter 03 exercises, answered: partial RoPE in the interleaved layout with per-sequence positions, and the
conversion of a half-layout checkpoint back to the interleaved layout."""

import torch


def apply_partial_rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, base: float = 10000.0
                       ) -> torch.Tensor:
    """Rotate the first `rotary_dim` dimensions of x, interleaved pairs (see exercises/ch03_rope.py)."""
    head_dim = x.shape[-1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in 2..{head_dim}, got {rotary_dim}")
    # The frequencies belong to the rotated dimensions only: θ_i = base^(-2i / rotary_dim).
    theta = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = positions.to(torch.float64)[:, None, :, None] * theta  # [B, 1 (heads), T, rotary_dim / 2]
    dtype = torch.promote_types(x.dtype, torch.float32)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

    rotated, passed = x[..., :rotary_dim].to(dtype), x[..., rotary_dim:]
    even, odd = rotated[..., 0::2], rotated[..., 1::2]  # pair i is (2i, 2i + 1)
    turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)
    return torch.cat((turned.to(x.dtype), passed), dim=-1)


def half_to_interleaved_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder the rows of a half-layout W_q or W_k for the interleaved layout (see exercises/ch03_rope.py)."""
    if head_dim % 2 or w.shape[0] % head_dim:
        raise ValueError(f"head_dim {head_dim} must be even and divide the {w.shape[0]} rows of w")
    half = head_dim // 2
    # Interleaved dimension 2i is half-layout dimension i, and 2i + 1 is i + head_dim / 2.
    order = torch.stack((torch.arange(half), torch.arange(half) + half), dim=-1).flatten()
    return w.view(-1, head_dim, *w.shape[1:])[:, order].reshape(w.shape)
