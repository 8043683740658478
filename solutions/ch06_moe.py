"""Chapter 06 exercises, answered: the sequence-wise balance loss, dropping by score, and group-limited routing."""

import torch
import torch.nn.functional as F


def sequence_balance_loss(probs: torch.Tensor, indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, unweighted (see exercises/ch06_moe.py)."""
    _, seq_len, k = indices.shape
    # f: the share of each sequence's T·k routing slots that went to each expert (a count, no gradient).
    counts = F.one_hot(indices, n_experts).sum(dim=(1, 2)).to(probs.dtype)  # [B, N]
    f = counts / (seq_len * k)
    p = probs.mean(dim=1)  # [B, N]: each sequence's average router probability per expert
    return (n_experts * (f * p).sum(dim=-1)).mean()


def drop_by_score(indices: torch.Tensor, gates: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """Which token-slots each expert keeps when it keeps its `capacity` highest gates (see exercises/ch06_moe.py)."""
    num_tokens, k = indices.shape
    # Slot r·T + t is choice r of token t; this order is also the tie-break (GShard's priority).
    expert = indices.t().reshape(-1)
    gate = gates.detach().t().reshape(-1)
    by_gate = torch.argsort(-gate, stable=True)  # best gate first, ties in slot order
    order = by_gate[torch.argsort(expert[by_gate], stable=True)]  # grouped by expert, best gate first inside
    counts = torch.bincount(expert, minlength=n_experts)
    starts = counts.cumsum(0) - counts
    rank_in_expert = torch.arange(order.numel()) - starts[expert[order]]
    keep = torch.zeros(num_tokens * k, dtype=torch.bool)
    keep[order[rank_in_expert < capacity]] = True
    return keep.view(k, num_tokens).t()


def group_limited_top_k(scores: torch.Tensor, k: int, n_groups: int, top_groups: int) -> torch.Tensor:
    """Top-k experts chosen inside the `top_groups` best groups (see exercises/ch06_moe.py)."""
    num_tokens, n_experts = scores.shape
    grouped = scores.view(num_tokens, n_groups, n_experts // n_groups)
    group_score = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]: the sum of each group's two best
    best_groups = torch.sort(group_score, dim=-1, descending=True, stable=True).indices[:, :top_groups]
    allowed = torch.zeros(num_tokens, n_groups, dtype=torch.bool).scatter(1, best_groups, True)
    masked = scores.masked_fill(~allowed.repeat_interleave(n_experts // n_groups, dim=1), float("-inf"))
    return torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
