"""The FlashAttention-2 backward in Triton (chapter 19): nothing of the forward is kept but O and L.

For one tile of scores, with D = rowsum(dO ∘ O) per query (computed once, before the kernels):

    P = exp(S − L)      dV += Pᵀ dO      dP = dO Vᵀ      dS = P ∘ (dP − D)      dQ += dS K·scale      dK += dSᵀ Q·scale

P is recomputed from the log-sum-exp L, so no S × S tensor is ever stored (Dao 2023, "FlashAttention-2",
Algorithm 2). D replaces rowsum(P ∘ dP) — equal because O = P V — and needs only O, not P. Two kernels so that
nothing is added atomically: `_dkdv_kernel` owns one key/value tile and walks the query tiles (and, with GQA, the
G query heads) that can see it; `_dq_kernel` owns one query tile and walks the key tiles its forward walked.
"""

from __future__ import annotations

import triton
import triton.language as tl

from minidist.kernels.flash_forward import kv_range


@triton.jit
def q_range(start_n, seq_len, ENDS, row, CAUSAL: tl.constexpr, DOCS: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr):
    """[lo, hi) of the query positions that can see key tile `start_n`, lo a multiple of BLOCK_M: causal starts at
    the query tile holding the tile's first key; documents end after the document of its last key (`ENDS`: for each
    token, the last position of its document)."""
    lo = 0
    if CAUSAL:
        lo = (start_n // BLOCK_M) * BLOCK_M
    hi = seq_len
    if DOCS:
        last = tl.minimum(start_n + BLOCK_N, seq_len) - 1
        hi = tl.load(ENDS + row * seq_len + last) + 1
    return lo, hi


@triton.jit
def _tile_grads(q, k_t, v_t, do, lse, delta, rows, cols, id_q, id_k, seq_len, scale,
                CAUSAL: tl.constexpr, DOCS: tl.constexpr, PRECISION: tl.constexpr):
    """(P, dS) of one tile of scores: P recomputed from L, masked entries 0."""
    s = tl.dot(q, k_t, input_precision=PRECISION) * scale
    keep = (rows[:, None] < seq_len) & (cols[None, :] < seq_len)
    if CAUSAL:
        keep = keep & (cols[None, :] <= rows[:, None])
    if DOCS:
        keep = keep & (id_q[:, None] == id_k[None, :])
    p = tl.where(keep, tl.exp(s - lse[:, None]), 0.0)
    dp = tl.dot(do, v_t, input_precision=PRECISION)
    return p, p * (dp - delta[:, None])


@triton.jit
def _dkdv_kernel(Q, K, V, DO, L, DELTA, DK, DV, IDS, ENDS,
                 sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sd_b, sd_h, sd_s,
                 seq_len, heads, kv_heads, group, d_qk, d_v, scale,
                 CAUSAL: tl.constexpr, DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    start_n, bk = tl.program_id(0) * BLOCK_N, tl.program_id(1)
    b, kv = bk // kv_heads, bk % kv_heads
    cols, rows0 = start_n + tl.arange(0, BLOCK_N), tl.arange(0, BLOCK_M)
    dq_, dv_ = tl.arange(0, BLOCK_DQK), tl.arange(0, BLOCK_DV)
    col_ok = cols < seq_len
    k = tl.load(K + b * sk_b + kv * sk_h + cols[:, None] * sk_s + dq_[None, :],
                mask=col_ok[:, None] & (dq_[None, :] < d_qk), other=0.0)
    v = tl.load(V + b * sv_b + kv * sv_h + cols[:, None] * sv_s + dv_[None, :],
                mask=col_ok[:, None] & (dv_[None, :] < d_v), other=0.0)
    id_k = cols
    if DOCS:
        id_k = tl.load(IDS + b * seq_len + cols, mask=col_ok, other=-2)
    dk = tl.zeros([BLOCK_N, BLOCK_DQK], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, hi = q_range(start_n, seq_len, ENDS, b, CAUSAL, DOCS, BLOCK_M, BLOCK_N)
    for g in range(0, group):  # every query head that reads this key/value head
        h = kv * group + g
        for start_m in range(lo, hi, BLOCK_M):
            rows = start_m + rows0
            row_ok = rows < seq_len
            q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_s + dq_[None, :],
                        mask=row_ok[:, None] & (dq_[None, :] < d_qk), other=0.0)
            do = tl.load(DO + (b * heads + h) * seq_len * d_v + rows[:, None] * d_v + dv_[None, :],
                         mask=row_ok[:, None] & (dv_[None, :] < d_v), other=0.0)
            lse = tl.load(L + (b * heads + h) * seq_len + rows, mask=row_ok, other=0.0)
            delta = tl.load(DELTA + (b * heads + h) * seq_len + rows, mask=row_ok, other=0.0)
            id_q = rows
            if DOCS:
                id_q = tl.load(IDS + b * seq_len + rows, mask=row_ok, other=-1)
            p, ds = _tile_grads(q, tl.trans(k), tl.trans(v), do, lse, delta, rows, cols, id_q, id_k, seq_len, scale,
                                CAUSAL, DOCS, PRECISION)
            dv += tl.dot(tl.trans(p).to(do.dtype), do, input_precision=PRECISION)
            dk += tl.dot(tl.trans(ds).to(q.dtype), q, input_precision=PRECISION) * scale
    out = col_ok[:, None]
    tl.store(DK + b * sd_b + kv * sd_h + cols[:, None] * sd_s + dq_[None, :], dk.to(DK.dtype.element_ty),
             mask=out & (dq_[None, :] < d_qk))
    tl.store(DV + (b * kv_heads + kv) * seq_len * d_v + cols[:, None] * d_v + dv_[None, :],
             dv.to(DV.dtype.element_ty), mask=out & (dv_[None, :] < d_v))


@triton.jit
def _dq_kernel(Q, K, V, DO, L, DELTA, DQ, IDS, STARTS,
               sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
               seq_len, heads, group, d_qk, d_v, scale,
               CAUSAL: tl.constexpr, DOCS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr):
    start_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    kv = h // group
    rows, cols0 = start_m * BLOCK_M + tl.arange(0, BLOCK_M), tl.arange(0, BLOCK_N)
    dq_, dv_ = tl.arange(0, BLOCK_DQK), tl.arange(0, BLOCK_DV)
    row_ok = rows < seq_len
    q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_s + dq_[None, :],
                mask=row_ok[:, None] & (dq_[None, :] < d_qk), other=0.0)
    do = tl.load(DO + bh * seq_len * d_v + rows[:, None] * d_v + dv_[None, :],
                 mask=row_ok[:, None] & (dv_[None, :] < d_v), other=0.0)
    lse = tl.load(L + bh * seq_len + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + bh * seq_len + rows, mask=row_ok, other=0.0)
    id_q = rows
    if DOCS:
        id_q = tl.load(IDS + b * seq_len + rows, mask=row_ok, other=-1)
    dq = tl.zeros([BLOCK_M, BLOCK_DQK], tl.float32)
    lo, hi = kv_range(start_m, seq_len, STARTS, b, CAUSAL, DOCS, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + cols0
        col_ok = cols < seq_len
        k = tl.load(K + b * sk_b + kv * sk_h + cols[:, None] * sk_s + dq_[None, :],
                    mask=col_ok[:, None] & (dq_[None, :] < d_qk), other=0.0)
        v_t = tl.load(V + b * sv_b + kv * sv_h + cols[None, :] * sv_s + dv_[:, None],
                      mask=col_ok[None, :] & (dv_[:, None] < d_v), other=0.0)
        id_k = cols
        if DOCS:
            id_k = tl.load(IDS + b * seq_len + cols, mask=col_ok, other=-2)
        _, ds = _tile_grads(q, tl.trans(k), v_t, do, lse, delta, rows, cols, id_q, id_k, seq_len, scale,
                            CAUSAL, DOCS, PRECISION)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION) * scale
    tl.store(DQ + b * sq_b + h * sq_h + rows[:, None] * sq_s + dq_[None, :], dq.to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (dq_[None, :] < d_qk))
