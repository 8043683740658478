"""Chapter 10 exercises, answered: the online-softmax merge of two partial attention results, the zig-zag
sequence split with its inverse, and ring attention on real ranks."""

import torch
import torch.distributed as dist


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets (see exercises/ch10_context.py)."""
    lse = torch.logaddexp(lse_a, lse_b)  # log(e^a + e^b) without overflow, and −inf + −inf = −inf
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # both sides empty: weights 0, not NaN
    w_a, w_b = torch.exp(lse_a - safe), torch.exp(lse_b - safe)
    return w_a[..., None] * out_a + w_b[..., None] * out_b, lse


def zigzag_shard_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions rank `rank` holds under the zig-zag split (see exercises/ch10_context.py)."""
    chunk = seq_len // (2 * cp)
    first, second = rank, 2 * cp - 1 - rank
    return torch.cat([torch.arange(first * chunk, (first + 1) * chunk),
                      torch.arange(second * chunk, (second + 1) * chunk)])


def zigzag_unshard_index(seq_len: int, cp: int) -> torch.Tensor:
    """Where each global position sits in the ranks' shards laid end to end (see exercises/ch10_context.py)."""
    held = torch.cat([zigzag_shard_index(seq_len, cp, r) for r in range(cp)])  # held[i] = position of slot i
    return torch.argsort(held)  # the inverse permutation: slot of each position


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Causal attention of this rank's zig-zag queries over the whole sequence, K/V passed around the ring (see
    exercises/ch10_context.py)."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    mine = zigzag_shard_index(seq_len, cp, rank)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
    kv = torch.stack([k, v]).contiguous()
    for step in range(cp):
        pending, incoming = [], torch.empty_like(kv)
        if step < cp - 1:  # start the next block on its way before computing on this one: the transfer overlaps
            pending = dist.batch_isend_irecv([dist.P2POp(dist.isend, kv, (rank + 1) % cp),
                                              dist.P2POp(dist.irecv, incoming, (rank - 1) % cp)])
        source = (rank - step) % cp  # after `step` hops to the right, the block came from rank − step
        visible = zigzag_shard_index(seq_len, cp, source)[None, :] <= mine[:, None]
        if visible.any():  # a block entirely in this rank's future is skipped, not computed and masked
            scores = (q @ kv[0].transpose(-1, -2)) * q.shape[-1] ** -0.5
            scores = scores.masked_fill(~visible, float("-inf"))
            block_lse = torch.logsumexp(scores, dim=-1)
            safe = torch.where(torch.isinf(block_lse), torch.zeros_like(block_lse), block_lse)
            block_out = torch.exp(scores - safe[..., None]) @ kv[1]
            out, lse = merge_partials(out, lse, block_out, block_lse)
        for work in pending:
            work.wait()
        kv = incoming
    return out
