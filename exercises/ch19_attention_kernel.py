"""Chapter 19 exercises: the three pieces of a FlashAttention-2 kernel, written in plain torch for one tile at a
time — what one Triton program of `minidist/kernels/` does, without Triton.

Grade your answers with `make grade CH=19`. The grader checks:
  - forward_tile_loop: equal to softmax(q kᵀ·scale) v and its log-sum-exp, with key tiles whose scores grow (every
    tile raises the running maximum, so a missed rescale shows), a partial last tile, and a mask under which some
    rows see nothing in their first tile (no NaN allowed);
  - kv_tile_backward: each key/value tile's dK, dV and its share of dQ, summed over the tiles, equal autograd's
    gradients of full attention; D must come from the final O, P from the final log-sum-exp;
  - causal_kv_range: the key range a query tile visits covers every key its queries may see and no tile that is
    wholly hidden, for square and unequal tiles, a partial last tile, and documents that start inside a tile.
"""

import torch


def forward_tile_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, block_n: int,
                      mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query tile against all keys, one key tile at a time (FlashAttention-2's forward, Algorithm 1 of Dao 2023).

    q [M, D] is the tile of queries; k [N, D], v [N, Dv] all keys and values; `mask` [M, N] (True where a query may
    see a key) or None. Return (out [M, Dv], lse [M]): softmax(q kᵀ·scale, masked) v and the log-sum-exp of each
    row's (scaled, masked) scores. Every row sees at least one key somewhere.

    Never build the whole [M, N] score matrix: walk the keys in tiles k[start:start + block_n] (the last may be
    shorter), keeping per row a running maximum m (start at −inf), a running sum l of exp(s − m) and an
    accumulator acc of exp(s − m) @ v. When a tile brings a larger maximum m_new, what you accumulated was
    computed against the old maximum: multiply l and acc by alpha = exp(m − m_new) before adding this tile's terms.
    At the end out = acc / l and lse = m + log l.

    Masked scores are −inf. A row whose tiles so far were all masked still has m = −inf, and exp(−inf − (−inf)) is
    NaN: use 0 in place of a maximum that is still −inf when you subtract it (its exp terms are 0 anyway).

    Hints: torch.maximum, amax(dim=1), torch.where(torch.isinf(...)); broadcast per-row vectors with [:, None].
    """
    raise NotImplementedError


def kv_tile_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, dout: torch.Tensor,
                     lse: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of attention for ONE key/value tile, as FlashAttention-2's backward does it (no mask here).

    q [M, D] are all the queries; k [Nt, D], v [Nt, Dv] one tile of keys and values; out [M, Dv] and lse [M] the
    FINAL output and log-sum-exp of the forward over ALL keys (not just this tile); dout [M, Dv] the gradient of
    the loss with respect to out. Return (dq_part [M, D], dk [Nt, D], dv [Nt, Dv]): this tile's contribution to
    dq (the caller sums them over the tiles), and the tile's full dk and dv.

    The probabilities are recomputed, not stored: P = exp(q kᵀ·scale − lse) is this tile's block of the full
    softmax, because lse normalizes over all keys. Then dV = Pᵀ dO, dP = dO Vᵀ, and the softmax's backward
    dS = P ∘ (dP − D) needs D_i = Σ_j P_ij dP_ij over ALL keys of row i — which one tile cannot sum. But
    Σ_j P_ij dP_ij = Σ_j P_ij (dO_i · V_j) = dO_i · O_i, so D = rowsum(dO ∘ O) from the final output. Finally
    dQ_part = dS K·scale and dK = dSᵀ Q·scale (the scale multiplied the scores).

    Hints: four matrix products and one row sum; no softmax call.
    """
    raise NotImplementedError


def causal_kv_range(start_m: int, block_m: int, block_n: int, seq_len: int, first_key: int = 0) -> tuple[int, int]:
    """The key positions [lo, hi) that query tile `start_m` (queries start_m·block_m .. (start_m+1)·block_m − 1,
    fewer in a partial last tile) visits under the causal mask, in tiles of block_n keys starting at lo.

    Query i sees keys j <= i, so the tile's last query bounds the keys: hi is one past it, and no further than the
    sequence. The tile on the diagonal is visited (partly masked inside), every key tile after it is skipped.
    `first_key`: with document masks, the first key any query of the tile may see (the start of its first query's
    document); the walk starts at the key tile that holds it, so lo must be a multiple of block_n, at or below
    first_key. block_m and block_n need not be equal.

    Hints: min(...); integer division rounds a position down to its tile's start.
    """
    raise NotImplementedError
