"""Chapter 10 exercises, answered: the online-softmax merge of two partial attention results, and the zig-zag
sequence split with its inverse."""

import torch


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
