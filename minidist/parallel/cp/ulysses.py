"""Ulysses attention (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme
Long Sequence Transformer Models"): trade the sequence split for a head split around attention.

Outside attention rank r holds T/cp tokens of every head. One all-to-all turns that into every token of H/cp
heads: rank r sends head group j of its tokens to rank j and receives head group r of everybody's tokens. Attention
is then ordinary full-sequence causal attention on H/cp heads (any kernel: here torch's SDPA), and a second
all-to-all turns the output back. Backward: the same all-to-alls in reverse (an even all-to-all is its own
adjoint). Per rank and layer: (cp−1)/cp of this rank's q, k, v and output, forward and again backward; the volume
per rank falls as cp grows, unlike the ring's and all-gather's.

The received sequence arrives in shard order; with the zig-zag layout it is put back into causal order (and the
output back into shard order) with `sharding.unshard_all` / `shard_all`. The head split needs H/cp query heads per
rank; with grouped-query attention and fewer kv heads than cp, each kv head is replicated cp/H_kv times before the
all-to-all (more bytes: the trade is stated in `expected_cp_traffic`), so that rank r receives the kv head its
query heads read. Anything else is refused by `validate_context_parallel`.
"""

from __future__ import annotations

import torch
from einops import rearrange

from minidist.comm.communicator import Comm
from minidist.model.attention import causal_attention
from minidist.model.documents import Documents, document_attention
from minidist.parallel.cp.sharding import shard_all, unshard_all


class _AllToAll(torch.autograd.Function):
    """Even all-to-all along dim 0; its backward is the same all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.all_to_all(x.contiguous())

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.all_to_all(grad.contiguous()), None


def sequence_to_heads(x: torch.Tensor, comm: Comm, layout: str) -> torch.Tensor:
    """[B, H, T/cp, d] (this rank's tokens, all heads) -> [B, H/cp, T, d] (all tokens in order, its head group)."""
    cp = comm.size
    rows = rearrange(x, "b (p h) t d -> (p t) b h d", p=cp)  # head group p goes to rank p
    rows = _AllToAll.apply(rows, comm)  # now rows (source rank, its tokens): the sequence in shard order
    whole = unshard_all(rearrange(rows, "(r t) b h d -> r t b h d", r=cp), layout)
    return rearrange(whole, "s b h d -> b h s d")


def heads_to_sequence(y: torch.Tensor, comm: Comm, layout: str) -> torch.Tensor:
    """The inverse: [B, H/cp, T, d] -> [B, H, T/cp, d]."""
    cp = comm.size
    shards = shard_all(rearrange(y, "b h s d -> s b h d"), cp, layout)  # [cp, T/cp, b, h, d]
    rows = _AllToAll.apply(rearrange(shards, "r t b h d -> (r t) b h d"), comm)
    return rearrange(rows, "(p t) b h d -> b (p h) t d", p=cp)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, layout: str = "contiguous",
                      scale: float | None = None, docs: Documents | None = None) -> torch.Tensor:
    """Causal attention of this rank's tokens through a sequence <-> heads all-to-all; shapes as `ring_attention`.
    With `docs` (the whole sequence's, in order: what each rank attends over here) within each document."""
    cp, kv_heads = comm.size, k.shape[1]
    if kv_heads % cp:  # fewer kv heads than ranks: copy each to the ranks whose query heads read it
        k, v = k.repeat_interleave(cp // kv_heads, dim=1), v.repeat_interleave(cp // kv_heads, dim=1)
    q, k, v = (sequence_to_heads(t, comm, layout) for t in (q, k, v))
    y = causal_attention(q, k, v, scale) if docs is None else document_attention(q, k, v, docs, scale)
    return heads_to_sequence(y, comm, layout)
