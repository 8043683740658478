"""Chapter 03 exercises: partial RoPE in the interleaved layout, and converting a half-layout checkpoint back.

Grade your answers with `make grade CH=03`. The grader compares your rotation with `minidist.model.rope` on the
rotated slice, checks the relative-position property (shifting every position, even by a fraction, changes no
score), and converts a real minidist model from the half layout to the interleaved one with your function: the
two models must give the same logits.

The notebook rotates the whole head, at positions 0..T−1 shared by every sequence. Real code often does less and
more: GPT-J and GPT-NeoX rotate only the first `rotary_dim` dimensions of each head (MLA's decoupled rope
dimensions are the same idea), and a batch of packed or left-padded sequences gives each sequence its own
positions.

Layouts (chapter 03, section 4): "interleaved" pairs dimensions (2i, 2i + 1), "half" pairs (i, i + d/2).
`minidist.model.rope.interleaved_to_half_permutation(d)` is P with x_half = x_interleaved[..., P].
"""

import torch


def apply_partial_rope(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, base: float = 10000.0
                       ) -> torch.Tensor:
    """Rotate the first `rotary_dim` dimensions of every head of x, interleaved pairs; leave the rest unchanged.

    x: [B, H, T, head_dim] (queries or keys); positions: [B, T], the position of every token of every sequence —
    possibly fractional (position interpolation, chapter 04) and different for each sequence. Returns a new
    tensor of x's shape and dtype; x itself is not modified.

    For dimensions 0 .. rotary_dim − 1, pair i = (x_2i, x_2i+1) of the token at position m turns by m·θ_i:
        x'_2i   = x_2i · cos(m θ_i) − x_2i+1 · sin(m θ_i)
        x'_2i+1 = x_2i · sin(m θ_i) + x_2i+1 · cos(m θ_i),     θ_i = base^(−2i / rotary_dim),
    for i = 0 .. rotary_dim/2 − 1. Note the exponent: the frequencies span the *rotated* width, as in GPT-NeoX's
    `rotary_pct`. Dimensions rotary_dim .. head_dim − 1 pass through untouched. Raise ValueError unless rotary_dim
    is even and 0 < rotary_dim <= head_dim.

    Hints:
      - x[..., 0:r:2] and x[..., 1:r:2] are the two members of the pairs; torch.stack((a, b), dim=-1).flatten(-2)
        interleaves two tensors back.
      - angles of shape [B, 1, T, rotary_dim / 2] broadcast against the pairs of [B, H, T, rotary_dim / 2].
      - compute the angles in float64 (or at least float32) and return x's dtype.
    """
    raise NotImplementedError("exercise: interleaved RoPE on the first rotary_dim dimensions, per-sequence positions")


def half_to_interleaved_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Convert W_q or W_k of a half-layout checkpoint ([n_heads · head_dim, d_in], rows = output features) for a
    model that applies RoPE in the interleaved layout, without changing any attention score.

    Inside each head, the half layout keeps pair i in rows (i, i + head_dim/2); the interleaved layout wants it in
    rows (2i, 2i + 1). So interleaved row 2i is half row i, and interleaved row 2i + 1 is half row i + head_dim/2.
    The notebook's P goes the other way (interleaved -> half); this direction is its inverse permutation
    (torch.argsort(P)), applied to the rows of every head separately. Scores are unchanged because q and k are
    permuted alike: (P q)·(P k) = q·k.

    Return a new tensor of w's shape; raise ValueError if head_dim is odd or does not divide w.shape[0].

    Hint: view w as [n_heads, head_dim, d_in], index the middle dimension, reshape back.
    """
    raise NotImplementedError("exercise: reorder each head's rows from (i, i + d/2) pairs to (2i, 2i + 1) pairs")
