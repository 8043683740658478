"""Chapter 11 exercises, answered: send and receive counts, the destination order, its inverse, and the regrouping
of arrived rows by local expert."""

import torch


def send_counts(experts: torch.Tensor, n_experts: int, ep: int) -> torch.Tensor:
    """How many rows this rank sends to each of the ep ranks (see exercises/ch11_expert.py)."""
    owner = experts // (n_experts // ep)  # contiguous blocks of N/ep experts per rank
    return torch.bincount(owner, minlength=ep)


def receive_counts(count_matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """How many rows `rank` receives from each of the ep ranks (see exercises/ch11_expert.py)."""
    ep, n_experts = count_matrix.shape
    per_rank = n_experts // ep
    return count_matrix[:, rank * per_rank:(rank + 1) * per_rank].sum(dim=1)


def destination_order(experts: torch.Tensor, n_experts: int, ep: int) -> torch.Tensor:
    """The stable permutation that sorts a rank's slots by destination, then expert (see exercises/ch11_expert.py)."""
    return torch.argsort(experts, stable=True)  # contiguous blocks: by expert id is by destination rank too


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """inverse[order[i]] = i (see exercises/ch11_expert.py)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse


def local_expert_order(received: torch.Tensor) -> torch.Tensor:
    """The stable permutation that regroups arrived rows by local expert (see exercises/ch11_expert.py)."""
    n_sources, n_local = received.shape
    label = torch.arange(n_local, device=received.device).repeat(n_sources).repeat_interleave(received.flatten())
    return torch.argsort(label, stable=True)
