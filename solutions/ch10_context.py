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


def _exchange(x: torch.Tensor) -> torch.Tensor:
    """[cp, ...] chunks: chunk j to rank j; returns [cp, ...] with chunk i from rank i."""
    x = x.contiguous()  # before empty_like: a permuted x would give an output with permuted strides
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    return out


class _SequenceToHeads(torch.autograd.Function):
    """[B, H, T/cp, d] (all heads, my tokens) -> [B, H/cp, T, d] (my heads, all tokens); the adjoint is the way
    back: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _to_heads(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _to_sequence(grad)


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _to_sequence(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _to_heads(grad)


def _to_heads(x: torch.Tensor) -> torch.Tensor:
    cp = dist.get_world_size()
    b, h, n, d = x.shape
    got = _exchange(torch.stack(x.chunk(cp, dim=1)))  # [cp, B, H/cp, n, d]: rank i's tokens of my heads
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * n, d)


def _to_sequence(x: torch.Tensor) -> torch.Tensor:
    cp = dist.get_world_size()
    b, h, t, d = x.shape
    got = _exchange(x.reshape(b, h, cp, t // cp, d).permute(2, 0, 1, 3, 4))  # [cp, B, H/cp, T/cp, d]
    return torch.cat(got.unbind(0), dim=1)  # rank i's heads, in rank order: all heads of my tokens


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Ulysses: heads exchanged for the sequence around causal attention (see exercises/ch10_context.py)."""
    q, k, v = (_SequenceToHeads.apply(t) for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _HeadsToSequence.apply(out)
