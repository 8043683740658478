"""Documents packed into one sequence, and the attention that keeps them apart (issue 28, `--doc-mask`).

Training rows are cut from a stream of documents joined by an end-of-document token (`eod_id`), so one row holds
the tail of one document, a few whole ones and the head of the next. Without a mask, a token attends to the
documents before it in the row: text it has nothing to do with. With the document mask it sees only earlier tokens
of its own document (block-diagonal causal attention), and its RoPE position counts from its document's start, as it
would if the document had been run alone. Llama 3 trains with such a mask (Dubey et al. 2024, "The Llama 3 Herd of
Models", §3.2: attention between documents of one sequence is masked, which mattered most for long sequences).

The EOD token is the LAST token of the document it closes: the id increments after it. Ids are per row and start at
0; only equality between ids matters. The targets stay next-token targets everywhere (the EOD token's target is the
next document's first token: the one prediction that crosses a boundary, chapter 17 discusses it).

Two kernels: SDPA with a dense bool mask [B, 1, T, T] off CUDA (the CPU reference), and on CUDA flex attention
(Dong et al. 2024, "Flex Attention: A Programming Model for Generating Optimized Attention Kernels") with a
`BlockMask` built from the ids, which skips the tiles no document spans and never holds a T×T mask.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Docs = list[torch.Tensor] | None  # per micro-batch, the document ids [B, T] of its inputs (--doc-mask); None: no mask
Positions = Callable[[], tuple[torch.Tensor, torch.Tensor]]  # the global positions of queries [Tq] and keys [Tk]


def document_ids(tokens: torch.Tensor, eod_id: int) -> torch.Tensor:
    """The document index of every token of rows [..., T]: 0 from the row's start, +1 after each `eod_id` (the EOD
    token belongs to the document it closes). int32, on the tokens' device."""
    is_eod = (tokens == eod_id).to(torch.int32)
    return is_eod.cumsum(-1, dtype=torch.int32) - is_eod


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """The position of every token within its document ([..., T] ids -> [..., T] int64): 0 at each document's first
    token in the row (a row that starts inside a document counts from the row's start)."""
    index = torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape)
    starts = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    return index - torch.where(starts, index, torch.zeros_like(index)).cummax(-1).values


def document_mask(ids: torch.Tensor) -> torch.Tensor:
    """The block-diagonal causal mask of rows of ids [B, T]: bool [B, 1, T, T], True where query t may see key s
    (s <= t and the same document). Dense: for the CPU reference (and tests), never for a long sequence on a GPU."""
    t = ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
    return (causal & (ids[:, :, None] == ids[:, None, :]))[:, None]


def document_mask_mod(ids: torch.Tensor, q_index: torch.Tensor | None = None, k_index: torch.Tensor | None = None
                      ) -> Callable[..., torch.Tensor]:
    """flex attention's mask_mod of the same mask: (batch, head, query index, key index) -> visible. `q_index`,
    `k_index`: the global position of each query and key, when they are not 0..T−1 (`gathered_document_attention`)."""
    def visible(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        q = q if q_index is None else q_index[q]
        k = k if k_index is None else k_index[k]
        return (q >= k) & (ids[b, q] == ids[b, k])
    return visible


def attention_pairs(ids: torch.Tensor) -> torch.Tensor:
    """(query, key) pairs the document mask keeps over all rows of ids [..., T], for MFU: Σ over documents of
    l·(l+1)/2, each document's causal triangle. The query at position p of its document sees p + 1 keys, so the
    count is Σ (p + 1): a 0-d int64 tensor on the ids' device, no value read (the trainer reads a logging window's
    counts with its other figures). The plain causal count is B·T·(T+1)/2 (`dense_attention_pairs`)."""
    return (document_positions(ids) + 1).sum()


def dense_attention_pairs(rows: int, seq_len: int) -> int:
    """(query, key) pairs of the plain causal mask: seq_len·(seq_len+1)/2 per row."""
    return rows * seq_len * (seq_len + 1) // 2


@dataclass
class Documents:
    """What attention needs to keep documents apart in one forward: the ids [B, T] of the whole sequence in order
    (under context parallelism every rank holds all of them: the tiny int tensor is cut from the micro-batch, and a
    rank's keys are indexed by their global positions), and on CUDA the flex `BlockMask`s the attention cores ask
    for, built once per forward and shared by every block (`flex_mask`, `gathered_mask`). The model has each core
    prepare its mask before the blocks run (`prepare_documents`): a compiled block only reads it."""

    ids: torch.Tensor
    block_mask: object | None = None  # the whole sequence's (`flex_mask`)
    gathered: object | None = None  # this cp rank's queries against the all-gathered keys (`gathered_mask`)

    @classmethod
    def build(cls, ids: torch.Tensor) -> Documents:
        if ids.dim() != 2:
            raise ValueError(f"document ids must be [batch, seq], got shape {tuple(ids.shape)}")
        return cls(ids)

    def flex_mask(self) -> object | None:
        """The whole sequence's BlockMask on CUDA, built on the first call (ring and all-gather context parallelism
        never ask: they mask their share themselves); None off CUDA unless one was given."""
        if self.block_mask is None and self.ids.device.type == "cuda":
            from torch.nn.attention.flex_attention import create_block_mask

            b, t = self.ids.shape  # _compile: the tiles are decided block by block, never from a dense [B, T, T] grid
            self.block_mask = create_block_mask(document_mask_mod(self.ids), b, None, t, t, device=self.ids.device,
                                                _compile=True)
        return self.block_mask

    def gathered_mask(self, positions: Positions) -> object:
        """The BlockMask of queries and keys at the global positions `positions()` gives (`gathered_block_mask`),
        built once per forward, the positions asked for only then: a cp rank's are the same in every block."""
        if self.gathered is None:
            self.gathered = gathered_block_mask(self.ids, *positions())
        return self.gathered


def _flex(device_type: str) -> Callable[..., torch.Tensor]:
    """flex attention, compiled once on CUDA (eager flex is a slow reference, which is what a CPU test runs)."""
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled_flex() if device_type == "cuda" else flex_attention


@functools.cache
def _compiled_flex() -> Callable[..., torch.Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def gathered_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor | Documents,
                                positions: Positions, scale: float | None = None) -> torch.Tensor:
    """Queries and keys at any global positions of the sequence whose ids [B, T] are given (`positions()`: the
    queries' [Tq] and the keys' [Tk], context parallelism's zig-zag queries against the all-gathered keys in shard
    order), through flex attention with the BlockMask of (key <= query by global position, and one document); with
    `Documents`, the mask it built for this forward. The chunks are runs of consecutive positions, so the tiles stay
    whole or empty as in one sequence. Autograd is flex's own."""
    mask = ids.gathered_mask(positions) if isinstance(ids, Documents) else gathered_block_mask(ids, *positions())
    return _masked_flex(q, k, v, mask, scale)


def _masked_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object, scale: float | None
                 ) -> torch.Tensor:
    """flex attention of q to k, v under BlockMask `mask` (GQA when they have fewer heads than q)."""
    return _flex(q.device.type)(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


def gathered_block_mask(ids: torch.Tensor, q_index: torch.Tensor, k_index: torch.Tensor) -> object:
    """The BlockMask of (key <= query by global position, and one document) for queries and keys at the given
    global positions of the sequence whose ids [B, T] are given (compiled on CUDA, eager on the CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(document_mask_mod(ids, q_index, k_index), ids.shape[0], None, len(q_index),
                             len(k_index), device=ids.device, _compile=ids.device.type == "cuda")


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents,
                       scale: float | None = None) -> torch.Tensor:
    """Block-diagonal causal attention of q [B, H, T, d] to k, v [B, H_kv, T, ·] (GQA as `causal_attention`):
    flex attention where `docs` holds a BlockMask (CUDA), else SDPA with the dense bool mask."""
    mask = docs.flex_mask()
    if mask is not None:
        return _masked_flex(q, k, v, mask, scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(docs.ids), scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])
