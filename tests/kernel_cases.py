"""The Triton attention kernel's checks, run in a process of their own under Triton's interpreter
(`TRITON_INTERPRET=1` must be in the environment before Triton decorates the kernels, and would change every later
Triton import of the process that set it): tests/test_kernels.py starts `python tests/kernel_cases.py OUT.json`
with it set and asserts on the figures this writes. Each case compares the kernel with chapter 10's einsum
reference (`attend_block(..., fused=False)`, whose autograd gives the gradients) and with SDPA, forward, log-sum-exp
and gradients, as max |difference|.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minidist.kernels import flash, interpreted  # noqa: E402
from minidist.model.documents import document_ids, document_mask  # noqa: E402
from minidist.parallel.cp.blockwise import attend_block, with_documents  # noqa: E402

# name: (B, H, H_kv, S, D_qk, D_v, causal, (BLOCK_M, BLOCK_N), documents). Every S leaves a partial last tile.
CASES = {
    "causal mha": (2, 2, 2, 48, 16, 16, True, (32, 32), False),
    "causal gqa": (1, 4, 2, 80, 32, 32, True, (32, 16), False),
    "causal mqa": (1, 4, 1, 50, 16, 16, True, (16, 32), False),
    "full gqa": (2, 4, 2, 50, 32, 32, False, (32, 16), False),
    "mla heads 24/16": (1, 2, 2, 72, 24, 16, True, (32, 32), False),
    "documents gqa": (2, 4, 2, 72, 16, 16, True, (16, 16), True),
}


def doc_ids(batch: int, seq: int, seed: int) -> torch.Tensor:
    """Rows of short and long documents: an end-of-document token (0) at random places."""
    g = torch.Generator().manual_seed(seed)
    return document_ids(torch.randint(0, 12, (batch, seq), generator=g), 0)


def references(q, k, v, causal, ids):
    """(einsum (out, lse), SDPA out) for the same attention."""
    seq = q.shape[2]
    seen = "causal" if causal else "all"
    if ids is not None:
        seen = with_documents("causal", range(seq), range(seq), ids)
    einsum = attend_block(q, k, v, q.shape[-1] ** -0.5, seen, fused=False)
    gqa = q.shape[1] != k.shape[1]
    if ids is not None:
        sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(ids), enable_gqa=gqa)
    else:
        sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    return einsum, sdpa


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def one_case(batch, heads, kv_heads, seq, d_qk, d_v, causal, blocks, documents, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq, d_qk, generator=g, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq, d_qk, generator=g, requires_grad=True)
    v = torch.randn(batch, kv_heads, seq, d_v, generator=g, requires_grad=True)
    ids = doc_ids(batch, seq, seed) if documents else None
    out, lse = flash.flash_attention_with_lse(q, k, v, causal, None, ids, blocks)
    dout = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    (ref_out, ref_lse), sdpa = references(q, k, v, causal, ids)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    sdpa_grads = torch.autograd.grad(sdpa, (q, k, v), dout) if d_qk == d_v else ref_grads
    return {"out": max_diff(out, ref_out), "lse": max_diff(lse, ref_lse), "sdpa_out": max_diff(out, sdpa),
            "grads": [max_diff(a, b) for a, b in zip(grads, ref_grads)],
            "sdpa_grads": [max_diff(a, b) for a, b in zip(grads, sdpa_grads)],
            "scale": max(ref_out.abs().max().item(), *(r.abs().max().item() for r in ref_grads))}


def skipped_tiles() -> dict:
    """Tiles the masks hide must not be visited: NaN planted in them reaches no output or gradient that they
    cannot affect (a visited tile would spread it: 0 · NaN = NaN in the accumulators)."""
    seq, block = 64, 16
    ids = torch.zeros(1, seq, dtype=torch.int64)
    ids[0, 40:] = 1  # documents [0, 40) and [40, 64): the last query tile (48..63) sees key tiles 2 and 3 only
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, seq, 16, generator=g) for _ in range(3))
    poisoned = v.clone()
    poisoned[:, :, :block] = float("nan")  # key tile 0: outside the last query tile's document
    found = {}
    out = flash.flash_attention(q, k, poisoned, True, None, ids, (block, block))
    ref = flash.flash_attention(q, k, v, True, None, ids, (block, block))
    found["documents: last query tile finite"] = bool(torch.isfinite(out[:, :, 48:]).all())
    found["documents: last query tile equal"] = max_diff(out[:, :, 48:], ref[:, :, 48:])
    found["documents: tile 0 does reach its own queries"] = bool(torch.isnan(out[:, :, :block]).any())
    late = v.clone()
    late[:, :, seq - block:] = float("nan")  # the last key tile: after every query of the first tiles
    out = flash.flash_attention(q, k, late, True, None, None, (block, block))
    found["causal: first three query tiles finite"] = bool(torch.isfinite(out[:, :, :seq - block]).all())
    found.update(skipped_in_backward(q, k, v, ids, block))
    return found


def skipped_in_backward(q, k, v, ids, block) -> dict:
    """The backward's kv-tile programs skip the query tiles that cannot see them: a NaN upstream gradient at
    queries of the second document leaves the first document's key tiles' gradients finite."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = flash.flash_attention(q, k, v, True, None, ids, (block, block))
    dout = torch.ones_like(out)
    dout[:, :, 48:] = float("nan")  # query tile 3 sees key tiles 2 and 3 only
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return {"documents: dk, dv of key tiles 0-1 finite": bool(torch.isfinite(dk[:, :, :32]).all()
                                                               and torch.isfinite(dv[:, :, :32]).all())}


def half_precision() -> dict:
    """fp16 inputs (the GPU's dtypes: the probabilities and dS cast down for the matmuls, fp32 accumulators) against
    SDPA in fp32 on the same rounded inputs: max |difference| over the largest reference value. bf16 cannot be run
    here: triton 3.9's interpreter multiplies bf16's raw bits in `tl.dot` (numpy has no bf16; triton-lang/triton
    issue 11584), and the kernels' bf16 path is the fp16 one with another element type."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 4, 56, 32, generator=g).half().requires_grad_(True)
    k, v = (torch.randn(1, 2, 56, 32, generator=g).half().requires_grad_(True) for _ in range(2))
    out = flash.flash_attention(q, k, v, True, None, None, (16, 16))
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref, leaves, torch.ones_like(ref))
    rel = lambda a, b: max_diff(a.float(), b) / b.abs().max().item()  # noqa: E731
    return {"dtypes": [str(t.dtype) for t in (out, *grads)], "out": rel(out, ref),
            "grads": [rel(a, b) for a, b in zip(grads, ref_grads)]}


def refusals() -> dict:
    """One-line errors for what the kernels do not take."""
    found = {}
    for name, call in {"head 300": lambda: flash.head_block(300),
                       "tile 24": lambda: flash.check_inputs(*(torch.zeros(1, 1, 8, 16),) * 3, True, None, (24, 16)),
                       "heads 3 over 2": lambda: flash.check_inputs(torch.zeros(1, 3, 8, 16), *(torch.zeros(
                           1, 2, 8, 16),) * 2, True, None, (16, 16))}.items():
        try:
            call()
            found[name] = None
        except ValueError as e:
            found[name] = str(e)
    return found


def main(path: str) -> None:
    torch.set_num_threads(1)
    result = {"interpreted": interpreted(), "cases": {name: one_case(*case) for name, case in CASES.items()},
              "skipped": skipped_tiles(), "fp16": half_precision(), "refusals": refusals()}
    Path(path).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
