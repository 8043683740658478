"""All-gather key/value attention (Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.2): every rank gathers the
keys and values of the whole sequence, then attends its own queries to them.

Llama 3 chose it over the ring for two reasons the chapter measures: it is simpler (one collective, any mask), and
with grouped-query attention the keys and values are much smaller than the queries, so gathering them costs little.
Forward: one all-gather each of K and V over the cp group; backward: the gradients of the gathered K and V are
partial sums over the ranks' queries, so one reduce-scatter each brings every rank the summed gradient of its own
tokens. The gathered keys arrive in shard order (rank 0's tokens, then rank 1's, ...); the causal mask is built
from their global positions, so no reordering is needed. Per rank and layer: 2·(cp−1)/cp · |K + V of the whole
sequence| bytes (gather forward, reduce-scatter backward).
"""

from __future__ import annotations

import functools

import torch

from minidist.comm.communicator import Comm
from minidist.model.documents import Documents, gathered_document_attention
from minidist.parallel.cp.blockwise import Work, blockwise_attention
from minidist.parallel.cp.sharding import shard_all, shard_spans


class _GatherSequence(torch.autograd.Function):
    """[B, H, T/cp, d] -> [B, H, T, d] in shard order: all-gather forward, reduce-scatter of the gradient back."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return comm.all_gather(x.movedim(2, 0).contiguous()).movedim(0, 2)

    @staticmethod
    def backward(ctx, grad):
        return ctx.comm.reduce_scatter(grad.movedim(2, 0).contiguous()).movedim(0, 2), None


def gather_sequence(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Every rank's tokens of x [B, H, T/cp, d], concatenated along the sequence in rank order."""
    return _GatherSequence.apply(x, comm)


def gathered_positions(seq_len: int, rank: int, cp: int, layout: str, device: torch.device | str
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's query positions, every key's position in shard order) of a sequence all-gathered over cp."""
    positions = shard_all(torch.arange(seq_len, device=device), cp, layout)  # [cp, T/cp]: who holds what
    return positions[rank], positions.flatten()


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, layout: str = "zigzag",
                        scale: float | None = None, work: Work | None = None,
                        docs: torch.Tensor | Documents | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries to the all-gathered keys and values; shapes and `docs` as
    `ring_attention`. With documents on CUDA, the whole gathered block runs flex
    attention with a BlockMask (`gathered_document_attention`: no dense mask, FlashAttention-like tiles), else the
    blockwise kernel. `docs` as `Documents` (the model's): the BlockMask built once per forward, not per block."""
    cp = comm.size
    seq_len = q.shape[2] * cp
    k_all, v_all = gather_sequence(k, comm), gather_sequence(v, comm)
    if docs is not None and q.device.type == "cuda":
        positions = functools.partial(gathered_positions, seq_len, comm.rank, cp, layout, q.device)
        return gathered_document_attention(q, k_all, v_all, docs, positions, scale)  # asked for once per forward
    key_spans = [span for rank in range(cp) for span in shard_spans(seq_len, rank, cp, layout)]  # in shard order
    q_spans = shard_spans(seq_len, comm.rank, cp, layout)
    ids = docs.ids if isinstance(docs, Documents) else docs
    return blockwise_attention(q, k_all, v_all, scale, q_spans=q_spans, k_spans=key_spans, work=work, docs=ids)
