"""The FlashAttention-2 forward in Triton (chapter 19): one program per (query tile, batch·head).

A program loads its BLOCK_M queries into SRAM once, walks the key/value tiles its mask can reach, and keeps three
things per query row on chip: the running maximum m, the running sum l of exp(s − m), and the unnormalized output
acc. When a tile raises the maximum, the old sum and output are rescaled by exp(m_old − m_new): the online softmax
(Milakov & Gimelshein 2018; Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
Partitioning", Algorithm 1). At the end it writes O = acc / l and the log-sum-exp L = m + log l, which is all the
backward needs to recompute any tile's probabilities.

Grouped-query attention costs nothing extra: query head h reads key/value head h // G (G = H / H_kv), the layout
`repeat_interleave` would produce. Head sizes need not be powers of two (`tl.arange` does): the tiles are
BLOCK_D wide and the loads masked to D, so MLA's 24-wide queries and 16-wide values run as they are. Documents
(`--doc-mask`) skip whole tiles: a query tile starts its walk at the key tile holding its first query's document
start (`STARTS`: for each token, the position where its document begins), and masks by id inside the tiles it visits.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_range(start_m, seq_len, STARTS, row, CAUSAL: tl.constexpr, DOCS: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi) of the key positions query tile `start_m` must visit, lo a multiple of BLOCK_N: causal stops after
    the tile's last query (the diagonal tile is visited, partly masked); documents start at the tile holding the
    start of its first query's document (keys before it belong to earlier documents, for every query of the tile,
    because document ids only grow along a row)."""
    hi = seq_len
    if CAUSAL:
        hi = tl.minimum((start_m + 1) * BLOCK_M, seq_len)
    lo = 0
    if DOCS:
        lo = (tl.load(STARTS + row * seq_len + start_m * BLOCK_M) // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def _forward_kernel(Q, K, V, OUT, L, IDS, STARTS,
                    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s,
                    seq_len, heads, group, d_qk, d_v, scale,
                    CAUSAL: tl.constexpr, DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    start_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    kv = h // group  # the key/value head this query head reads (GQA)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols0 = tl.arange(0, BLOCK_N)
    dk, dv = tl.arange(0, BLOCK_DQK), tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_s + dk[None, :],
                mask=(rows[:, None] < seq_len) & (dk[None, :] < d_qk), other=0.0)
    if DOCS:
        id_q = tl.load(IDS + b * seq_len + rows, mask=rows < seq_len, other=-1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, hi = kv_range(start_m, seq_len, STARTS, b, CAUSAL, DOCS, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + cols0
        k_t = tl.load(K + b * sk_b + kv * sk_h + cols[None, :] * sk_s + dk[:, None],
                      mask=(cols[None, :] < seq_len) & (dk[:, None] < d_qk), other=0.0)  # [D, N]: K transposed
        v = tl.load(V + b * sv_b + kv * sv_h + cols[:, None] * sv_s + dv[None, :],
                    mask=(cols[:, None] < seq_len) & (dv[None, :] < d_v), other=0.0)
        s = tl.dot(q, k_t, input_precision=PRECISION) * scale
        keep = cols[None, :] < seq_len
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        if DOCS:
            id_k = tl.load(IDS + b * seq_len + cols, mask=cols < seq_len, other=-2)
            keep = keep & (id_q[:, None] == id_k[None, :])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet: no NaN
        alpha = tl.exp(m_i - m_safe)  # rescales what the earlier tiles accumulated
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(OUT + b * so_b + h * so_h + rows[:, None] * so_s + dv[None, :], out.to(OUT.dtype.element_ty),
             mask=(rows[:, None] < seq_len) & (dv[None, :] < d_v))
    tl.store(L + bh * seq_len + rows, m_i + tl.log(l_safe), mask=rows < seq_len)
