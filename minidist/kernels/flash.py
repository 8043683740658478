"""FlashAttention-2 in Triton as a PyTorch operator (chapter 19): `flash_attention(q, k, v)` with its backward.

Shapes as everywhere in minidist: q [B, H, S, D_qk], k [B, H_kv, S, D_qk], v [B, H_kv, S, D_v], H a multiple of
H_kv (GQA; query head h reads kv head h // (H / H_kv)). `causal` is SDPA's is_causal; `doc_ids` [B, S] (document
ids that never decrease along a row, `minidist.model.documents.document_ids`) make it block-diagonal causal, with
the tiles no document spans skipped, never visited. The forward saves O and the log-sum-exp L only; the backward
recomputes the probabilities from L (`flash_backward.py`).

On a GPU the kernels compile for the device; on a CPU they run under Triton's interpreter, which Triton selects
when `@triton.jit` decorates, i.e. when this module is imported with TRITON_INTERPRET=1 in the environment
(`minidist.kernels.interpreted` says whether it was).
"""

from __future__ import annotations

import torch
import triton

from minidist.kernels.flash_backward import _dkdv_kernel, _dq_kernel
from minidist.kernels.flash_forward import _forward_kernel

MAX_HEAD_DIM = 256  # a BLOCK_D wider than this would not fit one tile of queries in a GPU's shared memory
MIN_BLOCK = 16  # tl.dot's smallest operand side


def head_block(d: int) -> int:
    """The tile width for head size d: the next power of two (`tl.arange` needs one), at least 16; the loads are
    masked to d, so e.g. MLA's 24 runs in a 32-wide tile with zeros beyond it."""
    if not 0 < d <= MAX_HEAD_DIM:
        raise ValueError(f"head size {d}: the Triton attention kernel takes 1..{MAX_HEAD_DIM}; use "
                         "--attention-kernel sdpa")
    return max(MIN_BLOCK, triton.next_power_of_2(d))


def default_blocks(d: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 64 × 64 tiles, 32 × 32 for head sizes above 128 (SRAM holds q, k, v tiles of width D)."""
    return (64, 64) if head_block(d) <= 128 else (32, 32)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, doc_ids: torch.Tensor | None,
                 blocks: tuple[int, int]) -> None:
    """One-line ValueError for shapes the kernels do not take."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [B, H, S, D], got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:3] != v.shape[:3] or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must match q {tuple(q.shape)} in batch and "
                         "sequence (self-attention), and k q's head size")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads do not group over {k.shape[1]} key/value heads")
    for d in (q.shape[-1], v.shape[-1]):
        head_block(d)  # raises for a head size the tiles cannot take
    if doc_ids is not None and (not causal or tuple(doc_ids.shape) != (q.shape[0], q.shape[2])):
        raise ValueError(f"doc_ids must be [B, S] = {(q.shape[0], q.shape[2])} with causal=True (document masks are "
                         f"block-diagonal causal), got {tuple(doc_ids.shape)}, causal={causal}")
    for size in blocks:
        if size < MIN_BLOCK or size & (size - 1):
            raise ValueError(f"tile size {size}: use a power of two >= {MIN_BLOCK}")


def document_bounds(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each token of ids [B, S] (non-decreasing along a row): the first and the last position of its document,
    int32 [B, S] each: the tiles a query tile or a key tile can reach are decided from them."""
    ids = ids.contiguous()
    starts = torch.searchsorted(ids, ids, right=False)
    ends = torch.searchsorted(ids, ids, right=True) - 1
    return starts.to(torch.int32), ends.to(torch.int32)


def _precision(dtype: torch.dtype) -> str | None:
    """tl.dot's input precision: fp32 stays fp32 ("ieee"; Triton's default, TF32, would round the operands to 10
    mantissa bits); 16-bit inputs take the backend's default."""
    return "ieee" if dtype == torch.float32 else None


def _strides(*tensors: torch.Tensor) -> list[int]:
    return [s for t in tensors for s in t.stride()[:3]]


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  docs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, blocks: tuple[int, int]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [B, H, S, D_v] in q's dtype, L [B, H, S] fp32). `docs`: (ids, starts, ends) int32 [B, S], or None."""
    b, heads, seq, d_qk = q.shape
    out = torch.empty(b, heads, seq, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, heads, seq, dtype=torch.float32, device=q.device)
    ids, starts, _ = docs if docs is not None else (q, q, q)  # unread without documents
    grid = (triton.cdiv(seq, blocks[0]), b * heads)
    _forward_kernel[grid](q, k, v, out, lse, ids, starts, *_strides(q, k, v, out),
                          seq, heads, heads // k.shape[1], d_qk, v.shape[-1], scale,
                          CAUSAL=causal, DOCS=docs is not None, BLOCK_M=blocks[0], BLOCK_N=blocks[1],
                          BLOCK_DQK=head_block(d_qk), BLOCK_DV=head_block(v.shape[-1]), PRECISION=_precision(q.dtype))
    return out, lse


def flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float,
                   docs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, blocks: tuple[int, int]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the inputs' dtypes; dk, dv summed over each kv head's query heads."""
    b, heads, seq, d_qk = q.shape
    kv_heads, d_v = k.shape[1], v.shape[-1]
    dout = dout.to(q.dtype).contiguous()
    delta = (dout.float() * out.float()).sum(-1)  # D = rowsum(dO ∘ O): from O, never from P
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    dv = torch.empty(b, kv_heads, seq, d_v, dtype=v.dtype, device=v.device)
    ids, starts, ends = docs if docs is not None else (q, q, q)
    meta = dict(CAUSAL=causal, DOCS=docs is not None, BLOCK_M=blocks[0], BLOCK_N=blocks[1],
                BLOCK_DQK=head_block(d_qk), BLOCK_DV=head_block(d_v), PRECISION=_precision(q.dtype))
    _dkdv_kernel[(triton.cdiv(seq, blocks[1]), b * kv_heads)](
        q, k, v, dout, lse, delta, dk, dv, ids, ends, *_strides(q, k, v, dk),
        seq, heads, kv_heads, heads // kv_heads, d_qk, d_v, scale, **meta)
    _dq_kernel[(triton.cdiv(seq, blocks[0]), b * heads)](
        q, k, v, dout, lse, delta, dq, ids, starts, *_strides(q, k, v),
        seq, heads, heads // kv_heads, d_qk, d_v, scale, **meta)
    return dq, dk, dv


def _dense(x: torch.Tensor) -> torch.Tensor:
    """x with unit stride in the head dimension and a layout `empty_like` reproduces (the gradients share the
    inputs' strides)."""
    return x if x.stride(-1) == 1 and torch.empty_like(x).stride() == x.stride() else x.contiguous()


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, doc_ids, blocks):
        q, k, v = _dense(q), _dense(k.to(q.dtype)), _dense(v.to(q.dtype))
        docs = None if doc_ids is None else (doc_ids.to(torch.int32).contiguous(), *document_bounds(doc_ids))
        out, lse = flash_forward(q, k, v, causal, scale, docs, blocks)
        ctx.save_for_backward(q, k, v, out, lse, *(docs or ()))
        ctx.setup = (causal, scale, blocks)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, *docs = ctx.saved_tensors
        causal, scale, blocks = ctx.setup
        dq, dk, dv = flash_backward(dout, q, k, v, out, lse, causal, scale, tuple(docs) or None, blocks)
        return dq, dk, dv, None, None, None, None


def flash_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                             scale: float | None = None, doc_ids: torch.Tensor | None = None,
                             blocks: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q kᵀ·scale + mask) v, its log-sum-exp [B, H, S] fp32), differentiable in q, k, v (not through L).
    scale None: 1/√D_qk; blocks: (BLOCK_M, BLOCK_N), None for `default_blocks`."""
    blocks = blocks or default_blocks(max(q.shape[-1], v.shape[-1]))
    check_inputs(q, k, v, causal, doc_ids, blocks)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return FlashAttention.apply(q, k, v, causal, scale, doc_ids, blocks)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: float | None = None, doc_ids: torch.Tensor | None = None,
                    blocks: tuple[int, int] | None = None) -> torch.Tensor:
    """The attention output of `flash_attention_with_lse`, in q's dtype."""
    return flash_attention_with_lse(q, k, v, causal, scale, doc_ids, blocks)[0]
