"""Blockwise attention with the online softmax: the kernel all of chapter 10's context parallelism is built on.

Attention of a block of queries against a block of keys gives a partial result: the block's output O_b (normalized
within the block) and the log-sum-exp of its scores, L_b = log Σ_j exp(s_j). Two partial results over disjoint key
sets merge exactly (the online softmax: Milakov & Gimelshein 2018, "Online normalizer calculation for softmax";
Dao et al. 2022, "FlashAttention", Algorithm 1):

    L = log(e^{L_a} + e^{L_b})            O = e^{L_a − L}·O_a + e^{L_b − L}·O_b

so keys can arrive in any order, from any rank. The backward pass needs only the final O and L (Dao et al. 2022,
Algorithm 4, in the form of FlashAttention-2): per key block, P = exp(S − L), dV = Pᵀ dO, dP = dO Vᵀ,
dS = P ⊙ (dP − D) with D = rowsum(dO ⊙ O), dQ += dS K·scale, dK = dSᵀ Q·scale. No block's probabilities are saved:
they are recomputed, which is what keeps activation memory linear in the sequence length.

Two kernels behind one pair of functions, `attend_block` / `attend_block_backward` (the only code that touches
scores). The reference is plain torch (einsum), on any device and in any dtype, and handles any mask and MLA's
unequal key/value head sizes. torch's public SDPA returns no L, but its CPU flash kernel,
`aten._scaled_dot_product_flash_attention_for_cpu`, does, and its backward accepts the final O and L: on CPU, for
equal head sizes and blocks that are wholly visible or causal on the diagonal, that fused kernel runs instead
(`fused=None` picks it; both are checked equal in fp64). On CUDA, under bf16 autocast (the core hands the blocks
over in the autocast dtype, `in_autocast_dtype`), FlashAttention-2 runs: `aten._scaled_dot_product_flash_attention`
returns the log-sum-exp the same way and its backward accepts the final O and L (`block_kernel` decides).

Grouped-query attention is handled by grouping the query heads, never by repeating key/value heads: query head
j·g + i reads kv head j (g = H / H_kv), as `repeat_interleave` would lay it out. Shapes: q [B, H, Tq, d],
k [B, H_kv, Tk, d], v [B, H_kv, Tk, d_v]; masks [Tq, Tk] (or per row [B, Tq, Tk]), True where a query may see a
key.

Documents (`--doc-mask`): causality stays a function of the global index (the Python ranges below), and the
document condition is added from the ids of the whole sequence [B, T], which every cp rank holds: a block pair the
causal mask keeps gets the mask (causal & same document) [B, Tq, Tk] (`with_documents`), attended by the reference
kernel (the fused ones take no mask; on CUDA the all-gather variant hands documents to flex attention instead).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from einops import rearrange

Partial = tuple[torch.Tensor, torch.Tensor]  # (output [B, H, Tq, d_v], log-sum-exp [B, H, Tq]), fp32 or wider


@dataclass
class Work:
    """Unmasked (query, key) position pairs a rank scored in its forwards: the causal mask's share of the work
    (with document ids, the causal count still: the pairs a document mask also hides are scored, then masked)."""

    scores: int = 0


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scores, sums and partial outputs in fp32 at least (fp64 stays fp64), whatever autocast computes elsewhere."""
    return torch.promote_types(dtype, torch.float32)


def no_autocast(x: torch.Tensor) -> contextlib.AbstractContextManager:
    return torch.autocast(device_type=x.device.type, enabled=False)


def in_autocast_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """On CUDA under autocast, the tensors in its dtype (what SDPA gets in the plain attention, and what the fused
    kernel takes); elsewhere unchanged, so a CPU run computes as it always has."""
    device = tensors[0].device.type
    if device != "cuda" or not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)


def visibility(q: range, k: range, device: torch.device) -> torch.Tensor | str:
    """The causal mask between a chunk of query positions and a chunk of key positions: "all" (no mask needed),
    "none" (skip the block), "causal" (the same positions: the lower triangle) or a bool [Tq, Tk] mask on `device`,
    True where key <= query. The chunks are Python ranges (`sharding.shard_spans`): every `if` here is decided on
    the host, where deciding from device tensors would wait for the GPU at each block pair."""
    if k.stop - 1 <= q.start:
        return "all"
    if k.start > q.stop - 1:
        return "none"
    if q == k:
        return "causal"
    keys, queries = torch.arange(k.start, k.stop, device=device), torch.arange(q.start, q.stop, device=device)
    return keys[None, :] <= queries[:, None]


def visible_pairs(q: range, k: range) -> int:
    """How many (query, key) pairs of two chunks the causal mask keeps: key <= query, counted on the host in closed
    form (query p sees min(p + 1, k.stop) − k.start keys, none below k.start: a rising run, then whole rows)."""
    lo, hi = max(q.start, k.start), min(q.stop, k.stop)  # queries inside the keys' span: 1, 2, ... keys each
    rising = (hi - lo) * (lo + hi + 1 - 2 * k.start) // 2 if hi > lo else 0
    return rising + len(k) * max(0, q.stop - max(q.start, k.stop))  # queries past the span see all of it


def with_documents(seen: torch.Tensor | str, q: range, k: range, docs: torch.Tensor | None) -> torch.Tensor | str:
    """`visibility` with the document condition: a bool [B, Tq, Tk] mask, True where the causal mask keeps the pair
    and both tokens are of one document (docs: the ids [B, T] of the whole sequence, indexed by global position)."""
    if docs is None or (isinstance(seen, str) and seen == "none"):
        return seen
    same = docs[:, q.start:q.stop, None] == docs[:, None, k.start:k.stop]
    causal = _mask(seen, len(q), docs.device)
    return same if causal is None else same & causal


def _mask(seen: torch.Tensor | str, q_len: int, device: torch.device) -> torch.Tensor | None:
    """A visibility as a bool mask for the plain kernel (None: everything visible)."""
    if isinstance(seen, torch.Tensor):
        return seen
    return torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril() if seen == "causal" else None


def flash_cuda_fits(head_dim: int) -> bool:
    """FlashAttention-2's CUDA contract on the head size: a multiple of 8, at most 256. Written by hand: torch's
    fake (meta) check of `_scaled_dot_product_flash_attention` accepts 12 and 264, the kernel refuses them."""
    return head_dim % 8 == 0 and head_dim <= 256


def block_kernel(device_type: str, dtype: torch.dtype, d_qk: int, d_v: int, masked: bool) -> str:
    """Which kernel attends one block: "flash_cpu" (torch's CPU flash kernel, any float dtype), "flash_cuda"
    (FlashAttention-2 on CUDA: bf16/fp16 inputs, `flash_cuda_fits` head sizes) or "einsum" (the reference: any
    device, dtype, mask, and MLA's unequal head sizes). `masked`: a mask beyond the causal triangle (fused kernels
    take none)."""
    if masked or d_qk != d_v:
        return "einsum"
    if device_type == "cpu":
        return "flash_cpu"
    if device_type == "cuda" and dtype in (torch.bfloat16, torch.float16) and flash_cuda_fits(d_qk):
        return "flash_cuda"
    return "einsum"


def _kernel(q: torch.Tensor, v: torch.Tensor, seen: torch.Tensor | str, fused: bool | None) -> str:
    """`block_kernel` for these operands; `fused` False forces the reference, True the device's fused kernel."""
    kernel = block_kernel(q.device.type, q.dtype, q.shape[-1], v.shape[-1], not isinstance(seen, str))
    if fused is None or fused == (kernel != "einsum"):
        return kernel
    return "einsum" if not fused else ("flash_cuda" if q.device.type == "cuda" else "flash_cpu")


def _flash_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> Partial:
    """FlashAttention-2 (torch's CUDA kernel) on 16-bit q, k, v: (output in the accumulate dtype, fp32 L). kv heads
    are repeated for the grouped queries (the kernel's own GQA is not relied on)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, scale=scale)[:2]
    return out.to(accumulate_dtype(q.dtype)), lse.float()


def _flash_cuda_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, ...]:
    """The backward of `_flash_cuda` given the final O and L; dk, dv summed over each kv head's query heads."""
    b, heads, t_k, g = k.shape[0], k.shape[1], k.shape[2], q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)  # dropout 0: the RNG state is never read
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.to(q.dtype), q, kr, vr, out.to(q.dtype), lse.float().contiguous(), None, None, q.shape[2], t_k, 0.0,
        causal, seed, offset, scale=scale)
    acc = accumulate_dtype(q.dtype)
    return (dq.to(acc), dk.view(b, heads, g, t_k, -1).sum(2, dtype=acc),
            dv.view(b, heads, g, t_k, -1).sum(2, dtype=acc))


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None) -> torch.Tensor:
    """Scaled scores [B, H_kv, g, Tq, Tk] of grouped queries; masked entries -inf."""
    q = rearrange(q, "b (k g) t d -> b k g t d", k=k.shape[1])
    s = torch.einsum("bkgtd,bksd->bkgts", q, k) * scale
    if mask is not None and mask.dim() == 3:  # per row: [B, Tq, Tk]
        mask = mask[:, None, None]
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def attend_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 seen: torch.Tensor | str = "all", fused: bool | None = None) -> Partial:
    """softmax(q kᵀ·scale) v over this block of keys only, and the log-sum-exp of each query's scores.

    `seen`: "all", "causal" or a bool mask (`visibility`). `fused`: the device's fused kernel (None: when it can,
    `block_kernel`). A query row that sees no key of the block gets output 0 and log-sum-exp −inf, which `merge`
    weighs by 0."""
    kernel = _kernel(q, v, seen, fused)
    if kernel == "flash_cuda":
        return _flash_cuda(q, k, v, scale, seen == "causal")
    acc = accumulate_dtype(q.dtype)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    if kernel == "flash_cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, seen == "causal",
                                                                              scale=scale)
        return out, lse.to(acc)
    s = _scores(q, k, scale, _mask(seen, q.shape[2], q.device))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # an all-masked row: exp(−inf − 0) = 0, no NaN
    p = torch.exp(s - m)
    total = p.sum(dim=-1, keepdim=True)
    out = torch.einsum("bkgts,bkse->bkgte", p / total.clamp_min(torch.finfo(acc).tiny), v)
    lse = (m + total.log()).squeeze(-1)
    return rearrange(out, "b k g t e -> b (k g) t e"), rearrange(lse, "b k g t -> b (k g) t")


def merge(a: Partial | None, b: Partial) -> Partial:
    """Two partial results over disjoint keys -> the result over their union (the online softmax's rescaling)."""
    if a is None:
        return b
    (out_a, lse_a), (out_b, lse_b) = a, b
    lse = torch.logaddexp(lse_a, lse_b)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # both −inf: weights 0, not NaN
    w_a, w_b = torch.exp(lse_a - lse_safe)[..., None], torch.exp(lse_b - lse_safe)[..., None]
    return w_a * out_a + w_b * out_b, lse


def attend_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor, scale: float, seen: torch.Tensor | str = "all",
                          delta: torch.Tensor | None = None, fused: bool | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this block, given the *final* output O and log-sum-exp L of the queries over all keys
    (and optionally delta = rowsum(dO ⊙ O), reused across blocks): P recomputed as exp(S − L) is then this block's
    share of the full softmax. dk and dv are summed over the query heads that share each kv head. All in the
    accumulate dtype."""
    kernel = _kernel(q, v, seen, fused)
    if kernel == "flash_cuda":
        return _flash_cuda_backward(dout, q, k, v, out, lse, scale, seen == "causal")
    acc = accumulate_dtype(q.dtype)
    q, k, v, dout = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    if kernel == "flash_cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out.to(acc), lse, 0.0, seen == "causal", scale=scale)
    if delta is None:
        delta = (dout * out.to(acc)).sum(-1)
    heads = k.shape[1]
    mask = _mask(seen, q.shape[2], q.device)
    p = torch.exp(_scores(q, k, scale, mask) - rearrange(lse, "b (k g) t -> b k g t", k=heads)[..., None])
    do = rearrange(dout, "b (k g) t e -> b k g t e", k=heads)
    dv = torch.einsum("bkgts,bkgte->bkse", p, do)
    dp = torch.einsum("bkgte,bkse->bkgts", do, v)
    ds = p * (dp - rearrange(delta, "b (k g) t -> b k g t", k=heads)[..., None])
    dq = torch.einsum("bkgts,bksd->bkgtd", ds, k) * scale
    dk = torch.einsum("bkgts,bkgtd->bksd", ds, rearrange(q, "b (k g) t d -> b k g t d", k=heads)) * scale
    return rearrange(dq, "b k g t d -> b (k g) t d"), dk, dv


# ---------------------------------------------------------------------------------------------------------------
# Chunks of queries against one block of keys (what a ring step, or the all-gathered keys, hand over)
# ---------------------------------------------------------------------------------------------------------------


def forward_pairs(qs: list[torch.Tensor], q_spans: list[range], k: torch.Tensor, v: torch.Tensor,
                  k_spans: list[range], scale: float, partials: list[Partial | None], work: Work | None = None,
                  docs: torch.Tensor | None = None) -> None:
    """Merge the attention of every query chunk to every key chunk of (k, v) into `partials`, skipping the pairs
    the causal mask hides entirely. `q_spans`, `k_spans`: each chunk's global positions (k is cut into
    len(k_spans) equal chunks). Chunk pairs are either wholly visible, wholly hidden, or diagonal; `docs` (the
    whole sequence's document ids) adds the document condition (`with_documents`)."""
    sizes = [len(span) for span in k_spans]
    for kc, vc, pc in zip(k.split(sizes, dim=2), v.split(sizes, dim=2), k_spans):
        for a, (qc, qp) in enumerate(zip(qs, q_spans)):
            seen = with_documents(visibility(qp, pc, qc.device), qp, pc, docs)
            if isinstance(seen, str) and seen == "none":
                continue
            partials[a] = merge(partials[a], attend_block(qc, kc, vc, scale, seen))
            if work is not None:
                work.scores += visible_pairs(qp, pc)


def backward_pairs(dos: list[torch.Tensor], qs: list[torch.Tensor], q_spans: list[range], k: torch.Tensor,
                   v: torch.Tensor, k_spans: list[range], outs: list[torch.Tensor], lses: list[torch.Tensor],
                   deltas: list[torch.Tensor], scale: float, dqs: list[torch.Tensor], docs: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The same pairs as `forward_pairs`, backwards: add into `dqs` (per query chunk) and return (dk, dv) of this
    block of keys, in the accumulate dtype."""
    dks, dvs, sizes = [], [], [len(span) for span in k_spans]
    for kc, vc, pc in zip(k.split(sizes, dim=2), v.split(sizes, dim=2), k_spans):
        dk = torch.zeros(kc.shape, dtype=dqs[0].dtype, device=kc.device)
        dv = torch.zeros(vc.shape, dtype=dqs[0].dtype, device=vc.device)
        for a, (qc, qp) in enumerate(zip(qs, q_spans)):
            seen = with_documents(visibility(qp, pc, qc.device), qp, pc, docs)
            if isinstance(seen, str) and seen == "none":
                continue
            dq_a, dk_a, dv_a = attend_block_backward(dos[a], qc, kc, vc, outs[a], lses[a], scale, seen, deltas[a])
            dqs[a] += dq_a
            dk += dk_a
            dv += dv_a
        dks.append(dk)
        dvs.append(dv)
    return torch.cat(dks, dim=2), torch.cat(dvs, dim=2)


def finish(partials: list[Partial], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The query chunks' partial results joined along the sequence: (output in `dtype`, log-sum-exp)."""
    out = torch.cat([o for o, _ in partials], dim=2)
    return out.to(dtype), torch.cat([lse for _, lse in partials], dim=2)


def deltas_of(dout: torch.Tensor, out: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """D = rowsum(dO ⊙ O) per query chunk (of `sizes` positions each), in the accumulate dtype."""
    acc = accumulate_dtype(out.dtype)
    return list((dout.to(acc) * out.to(acc)).sum(-1).split(sizes, dim=2))


# ---------------------------------------------------------------------------------------------------------------
# On one process: the whole sequence in blocks (the fp64 reference, and the all-gather variant's kernel)
# ---------------------------------------------------------------------------------------------------------------


class _Blockwise(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, q_spans, k_spans, scale, work, docs):
        with no_autocast(q):
            qs = list(q.split([len(span) for span in q_spans], dim=2))
            partials: list[Partial | None] = [None] * len(q_spans)
            forward_pairs(qs, q_spans, k, v, k_spans, scale, partials, work, docs)
            out, lse = finish(partials, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spans, ctx.scale, ctx.docs = (q_spans, k_spans), scale, docs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        q_spans, k_spans = ctx.spans
        sizes = [len(span) for span in q_spans]
        with no_autocast(q):
            qs = list(q.split(sizes, dim=2))
            dqs = [torch.zeros(qc.shape, dtype=accumulate_dtype(q.dtype), device=q.device) for qc in qs]
            dk, dv = backward_pairs(list(dout.split(sizes, dim=2)), qs, q_spans, k, v, k_spans,
                                    list(out.split(sizes, dim=2)), list(lse.split(sizes, dim=2)),
                                    deltas_of(dout, out, sizes), ctx.scale, dqs, ctx.docs)
        return torch.cat(dqs, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def equal_spans(length: int, chunks: int) -> list[range]:
    """0..length−1 cut as `Tensor.chunk(chunks)` cuts a dimension: ranges of ceil(length / chunks), the last shorter."""
    if chunks < 1:
        raise ValueError(f"chunks must be >= 1, got {chunks}")
    size = -(-length // chunks)
    return [range(start, min(start + size, length)) for start in range(0, length, size)]


def blockwise_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                        q_spans: list[range] | None = None, k_spans: list[range] | None = None, q_chunks: int = 1,
                        k_chunks: int = 1, work: Work | None = None, docs: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention computed block by block with the online softmax, with its own (recomputing) backward.

    Queries are cut into `q_chunks` and keys into `k_chunks` equal chunks at positions 0..T−1, or into the chunks
    whose global positions `q_spans` / `k_spans` give (keys all-gathered in shard order: the all-gather variant's
    kernel). `docs`: the whole sequence's document ids [B, T] (block-diagonal causal)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    q_spans = equal_spans(q.shape[2], q_chunks) if q_spans is None else q_spans
    k_spans = equal_spans(k.shape[2], k_chunks) if k_spans is None else k_spans
    return _Blockwise.apply(q, k, v, q_spans, k_spans, scale, work, docs)
