"""Chapter 11 exercises, answered: send and receive counts, the destination order, its inverse, the regrouping of
arrived rows by local expert; the differentiable uneven all-to-all, the dispatch and the combine."""

import torch
import torch.distributed as dist


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


class _AllToAllRows(torch.autograd.Function):
    """Rows to ranks by `send`, from ranks by `recv`; the adjoint is the reverse all-to-all, the splits swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        ctx.send, ctx.recv = send, recv
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv, input_split_sizes=send)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv)
        return back, None, None


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """A differentiable uneven all-to-all of rows (see exercises/ch11_expert.py)."""
    return _AllToAllRows.apply(x, send, recv)


def dispatch(x: torch.Tensor, experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Rows to their experts' ranks (see exercises/ch11_expert.py)."""
    ep = dist.get_world_size()
    per_rank = n_experts // ep
    order = destination_order(experts, n_experts, ep)
    send = send_counts(experts, n_experts, ep)
    # The counts exchange: rank j learns, from every rank i, how many of i's rows go to each of j's experts.
    mine = torch.bincount(experts, minlength=n_experts)
    arriving = torch.empty_like(mine)
    dist.all_to_all_single(arriving, mine)
    arriving = arriving.view(ep, per_rank)
    recv = arriving.sum(dim=1)
    received = all_to_all_rows(x[order], send.tolist(), recv.tolist())
    local_expert = torch.arange(per_rank, device=x.device).repeat(ep).repeat_interleave(arriving.flatten())
    return received, local_expert, (order, send.tolist(), recv.tolist())


def combine(y: torch.Tensor, state: object) -> torch.Tensor:
    """Outputs home, in slot order (see exercises/ch11_expert.py)."""
    order, send, recv = state
    back = all_to_all_rows(y, recv, send)
    return back[inverse_permutation(order)]
