"""MoE routers and balancing losses (chapter 06; the package docstring has the references)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from minidist.model.moe.dispatch import count_values


@dataclass
class Routing:
    logits: torch.Tensor  # [T, N] fp32 router logits
    probs: torch.Tensor  # [T, N] per-token distribution over experts used by the balance loss (rows sum to 1)
    indices: torch.Tensor  # [T, k] chosen experts, best first (int64)
    weights: torch.Tensor  # [T, k] gates that multiply the chosen experts' outputs (fp32)


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32, or in its own type when that is wider (float64 stays float64, for exact checks)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest entries of each row, best first; equal scores: the lower index wins (torch.topk promises no
    order for ties, a stable sort does)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def route(logits: torch.Tensor, top_k: int, router: str = "softmax", bias: torch.Tensor | None = None,
          renormalize: bool | None = None, scaling: float = 1.0) -> Routing:
    """Choose top_k experts per row of `logits` [T, N]; `bias` [N] shifts the choice but never the gates.

    Runs in at least float32 (float64 stays float64, for exact checks).
    """
    logits = at_least_fp32(logits)
    if renormalize is None:
        renormalize = top_k > 1
    if router == "softmax":
        scores = logits.softmax(dim=-1)
        probs = scores
    elif router == "sigmoid":
        scores = torch.sigmoid(logits)
        # DeepSeek-V3's balance loss uses the scores normalized over all experts (eq. 19-20).
        probs = scores / scores.sum(dim=-1, keepdim=True)
    else:
        raise ValueError(f"router {router!r} is unknown; choose 'softmax' or 'sigmoid'")
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    indices = top_k_indices(choice.detach(), top_k)
    weights = scores.gather(-1, indices)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(logits, probs, indices, weights * scaling)


# ----------------------------------------------------------------------------------------------------------------
# balancing losses


def sequence_balance_losses(router_probs: torch.Tensor, expert_indices: torch.Tensor, num_experts: int,
                            seq_len: int | None = None, reduce_counts: Callable | None = None) -> torch.Tensor:
    """N · Σᵢ fᵢ · Pᵢ of each sequence of `seq_len` consecutive tokens (default: all tokens are one sequence): [S].

    Switch's loss (Fedus et al. 2021, eq. 4-6) on the tokens of one sequence, i.e. DeepSeek-V3's sequence-wise
    balance loss (eq. 17-20). fᵢ = (token-slots routed to i) / (T · k): the fraction of the sequence's T·k routing
    decisions that chose i (counted before any capacity dropping), so Σ fᵢ = 1. Pᵢ = mean over its tokens of the
    router probability of i. Only P carries a gradient (f is a count).

    Context parallelism keeps it exact: `reduce_counts` sums each sequence's counts over its cp ranks (chapter 10).
    """
    probs = at_least_fp32(router_probs.reshape(-1, num_experts))
    tokens = probs.shape[0]
    indices = expert_indices.reshape(tokens, -1)
    seq_len = seq_len or tokens
    sequences = tokens // seq_len
    # counts[s, i]: slots of sequence s routed to i, one count over the pairs (s, i) numbered s·N + i
    pair = indices.reshape(sequences, -1) + num_experts * torch.arange(sequences, device=indices.device)[:, None]
    counts = count_values(pair.flatten(), sequences * num_experts).view(sequences, num_experts)
    counts = reduce_counts(counts) if reduce_counts is not None else counts  # a sequence split over cp ranks
    f = counts.to(probs.dtype) / counts.sum(dim=-1, keepdim=True)  # / (T·k)
    p = probs.reshape(sequences, seq_len, num_experts).mean(dim=1)
    return num_experts * (f * p).sum(dim=-1)


def load_balancing_loss(router_probs: torch.Tensor, expert_indices: torch.Tensor, num_experts: int,
                        seq_len: int | None = None) -> torch.Tensor:
    """The mean over sequences of `sequence_balance_losses`, unweighted: multiply by α. With seq_len None (all
    tokens one set) it is Switch's batch-wise loss.

    Uniform routing gives exactly 1; top-1 collapse onto one expert gives N; top-k routing concentrated on the
    same k experts gives N/k.
    """
    return sequence_balance_losses(router_probs, expert_indices, num_experts, seq_len).mean()


def router_z_loss(router_logits: torch.Tensor) -> torch.Tensor:
    """(1/B) Σ_tokens (log Σ_j exp x_j)² (Zoph et al. 2022, ST-MoE eq. 5): keeps router logits small."""
    logits = at_least_fp32(router_logits.reshape(-1, router_logits.shape[-1]))
    return torch.logsumexp(logits, dim=-1).square().mean()
