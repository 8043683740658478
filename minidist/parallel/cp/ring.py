"""Ring attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
Context"): each rank keeps its queries; the key/value blocks travel around the cp ring.

Forward, on rank r of cp: at step s it holds the keys and values of rank j = r − s (mod cp). It posts the send of
that block to r + 1 and the receive of the next one from r − 1, computes attention of its query chunks against the
block it holds (merging with the online softmax, `blockwise.merge`), then waits for the messages: the transfer
hides behind the compute when the block's compute takes longer than its transfer. After cp steps every query has
seen every key it may see; no rank ever held more than two key/value blocks.

Backward: the key/value blocks travel the ring again, and with each block its gradient accumulator dK_j, dV_j:
rank r adds its queries' share and passes the accumulator on; after cp steps each accumulator has visited every
rank, and a last hop brings it home to rank j. dQ stays local. Keys and values are sent with the kv heads they have
(grouped-query attention is never expanded before sending); the accumulators are fp32.

Bytes sent per rank and layer (|KV| = this rank's keys + values): forward (cp−1)·|KV|; backward (cp−1)·|KV| for
the blocks plus cp·|dKV| for the accumulators (`expected_cp_traffic` in `minidist.parallel.cp.traffic`).
"""

from __future__ import annotations

import torch

from minidist.comm.communicator import Comm
from minidist.parallel.cp.blockwise import (
    Partial,
    Work,
    accumulate_dtype,
    backward_pairs,
    deltas_of,
    finish,
    forward_pairs,
    no_autocast,
)
from minidist.parallel.cp.sharding import chunks_per_rank, shard_spans


def _pass_on(comm: Comm, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
    """Post sending `tensors` to the next rank and receiving their successors from the previous one."""
    nxt, prev = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    incoming = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]  # contiguous buffers
    handles = comm.exchange([(t, nxt) for t in tensors], [(t, prev) for t in incoming])
    return incoming, handles


def _wait(handles: list) -> None:
    for h in handles:
        h.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, comm, layout, scale, work, docs):
        cp, rank, n = comm.size, comm.rank, chunks_per_rank(layout)
        seq_len = q.shape[2] * cp
        q_spans = shard_spans(seq_len, rank, cp, layout)
        with no_autocast(q):
            qs = list(q.chunk(n, dim=2))
            partials: list[Partial | None] = [None] * n
            block = [k, v]
            for step in range(cp):
                source = (rank - step) % cp
                if step < cp - 1:  # the next block travels while this one is computed
                    incoming, handles = _pass_on(comm, block)
                forward_pairs(qs, q_spans, block[0], block[1], shard_spans(seq_len, source, cp, layout), scale,
                              partials, work, docs)
                if step < cp - 1:
                    _wait(handles)
                    block = incoming
            out, lse = finish(partials, q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.layout, ctx.scale, ctx.docs = comm, layout, scale, docs
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        comm, layout, scale = ctx.comm, ctx.layout, ctx.scale
        cp, rank, n = comm.size, comm.rank, chunks_per_rank(layout)
        seq_len = q.shape[2] * cp
        acc = accumulate_dtype(q.dtype)
        q_spans = shard_spans(seq_len, rank, cp, layout)
        with no_autocast(q):
            qs = list(q.chunk(n, dim=2))
            dos, outs, lses = list(dout.chunk(n, dim=2)), list(out.chunk(n, dim=2)), list(lse.chunk(n, dim=2))
            deltas = deltas_of(dout, out, [len(span) for span in q_spans])
            dqs = [torch.zeros(qc.shape, dtype=acc, device=q.device) for qc in qs]
            block = [k, v]
            grads = [torch.zeros(k.shape, dtype=acc, device=k.device), torch.zeros(v.shape, dtype=acc, device=v.device)]
            for step in range(cp):
                source = (rank - step) % cp
                if step < cp - 1:
                    incoming, handles = _pass_on(comm, block)
                k_spans = shard_spans(seq_len, source, cp, layout)
                dk, dv = backward_pairs(dos, qs, q_spans, block[0], block[1], k_spans, outs, lses, deltas, scale, dqs,
                                        ctx.docs)
                grads[0] += dk
                grads[1] += dv
                # The accumulators of block `source` move on with it; the last hop takes each one home.
                returned, grad_handles = _pass_on(comm, grads) if cp > 1 else (grads, [])
                if step < cp - 1:
                    _wait(handles)
                    block = incoming
                _wait(grad_handles)
                grads = returned
        dq = torch.cat(dqs, dim=2).to(q.dtype)
        return dq, grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None, None


@torch.compiler.disable  # a compiled block calls it eagerly: see the note below
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, layout: str = "zigzag",
                   scale: float | None = None, work: Work | None = None, docs: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence held by the ranks of `comm` (within each
    document with `docs`, the ids [B, T] of the whole sequence: a key block's are indexed by its global spans).

    q [B, H, T/cp, d], k [B, H_kv, T/cp, d], v [B, H_kv, T/cp, d_v]: this rank's tokens under `layout`
    ("zigzag" or "contiguous", `minidist.parallel.cp.sharding`). Returns [B, H, T/cp, d_v].

    Never traced by torch.compile (a graph break in a compiled block, as each collective is): which chunk pairs
    meet, and the positions they hold, are Python integers that change from one ring step to the next; traced,
    every step's spans were a recompile of `blockwise.forward_pairs`, and the recompile made them symbolic (a
    `len(range)` of symbols, which dynamo cannot take). Its kernels are the fused attention's anyway."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _RingAttention.apply(q, k, v, comm, layout, scale, work, docs)
