"""Expert parallelism (chapter 11): each MoE layer's experts are split over the ranks of an "ep" group, and every
token travels to the rank that holds its expert and back, by all-to-all (GShard, Lepikhin et al. 2020, §2.2-3;
Switch, Fedus et al. 2021, §2.2).

Placement: with N experts and ep ranks, rank r owns the contiguous block of experts [r·N/ep, (r+1)·N/ep). The
router, the shared experts, attention and everything else stay whole on every rank.

The token flow of one MoE layer on rank r, after the layer has routed its own tokens and sorted its kept slots by
expert (chapter 06's `plan_dispatch`; contiguous experts make "sorted by expert" also "sorted by destination"):

1. count:     counts[e] = slots for expert e, so rank r sends send[j] = Σ_{e on j} counts[e] rows to rank j;
2. exchange the counts (an all-to-all of N integers): recv[j, e] = rows rank j sends for r's local expert e;
3. dispatch:  an all-to-all with uneven splits (send out, recv.sum(1) in) of the rows for the other ranks; rows
              arrive grouped by source rank, then by local expert. It is only started: the rows rank r routed to
              its own experts never travel, and run through them while the others are on the wire;
4. wait; regroup the arrivals by local expert (a stable sort), run the local experts, and put the outputs back
   in arrival order (the inverse permutation);
5. combine:   the reverse all-to-all returns every row to the rank it came from, in the order it left, and the
              own rows' outputs go back in their place;
6. the layer multiplies by the gates and sums into the tokens (index_add), as on one device.

Backward is the same path reversed: the gradient of an all-to-all is the all-to-all with the splits swapped.
Nothing of chapter 06's layer changes: `ExpertParallelExperts` replaces its `Experts` module (the same interface,
rows grouped by expert in, rows out, and the same parameter names), so capacity, the losses and the aux-free bias
are computed before dispatch by the rank that owns the tokens, exactly as on one device.

Where the ep ranks come from, and the gradient rule (parallelize step 3; the groups are in `minidist.comm.topology`):
ep ranks are borrowed from the dp·cp replicas. An ep group is ep consecutive members of a dp_cp group; the
"edp" group joins the dp_cp ranks that hold the same experts. A rank back-propagates its tokens' losses times
R / C (R = dp·cp replicas, C the global count of target tokens). Its expert gradient then covers the tokens of
its whole ep group, so the sum over edp covers the global batch once, and the expert gradient is

    Σ_edp (local expert gradient) / (dp·cp)          (an average over edp would be ep times too large)

while dense gradients stay averaged over dp_cp. `minidist.parallel.ep.expert_grads` builds the two reductions.

Under tensor parallelism the MoE layer is not split: every tp rank routes the same tokens and runs its experts
whole, so the MoE weights get the same gradient on every tp rank (see `minidist.parallel.tp.tensor`).
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.comm.communicator import Comm, Handle
from minidist.model.config import ModelConfig
from minidist.model.moe.dispatch import Experts
from minidist.model.moe.stats import moe_layers
from minidist.parallel.placement import Split, placement_of, set_split

__all__ = [
    "ExpertParallelExperts", "apply_expert_parallel", "arrival_order", "expected_ep_bytes", "expert_owner",
    "is_expert_param", "local_experts", "start_all_to_all", "validate_expert_parallel",
]


def validate_expert_parallel(cfg: ModelConfig, ep: int, dp_cp: int) -> None:
    """One-line ValueError unless the experts can be split over `ep` of the `dp_cp` replicas (no process group)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise ValueError(f"ep must be a positive integer, got {ep!r}")
    if ep == 1:
        return
    if cfg.moe.n_experts == 0:
        raise ValueError(f"ep={ep} splits the experts of MoE layers, but this model is dense (moe.n_experts=0); "
                         "use --ep 1, or an MoE model (--set model.moe.n_experts=N)")
    if dp_cp % ep:
        fits = [d for d in range(1, dp_cp + 1) if dp_cp % d == 0]
        raise ValueError(f"ep={ep} does not divide dp*cp={dp_cp} (ep ranks are borrowed from the data-parallel "
                         f"replicas); pick ep from {fits}")
    if cfg.moe.n_experts % ep:
        fits = [d for d in range(1, cfg.moe.n_experts + 1) if cfg.moe.n_experts % d == 0 and dp_cp % d == 0]
        raise ValueError(f"ep={ep} does not divide n_experts={cfg.moe.n_experts} (each rank holds the same number "
                         f"of experts); pick ep from {fits}")


def local_experts(n_experts: int, ep: int, rank: int) -> range:
    """The experts rank `rank` of an ep group owns: a contiguous block of n_experts / ep."""
    per_rank = n_experts // ep
    return range(rank * per_rank, (rank + 1) * per_rank)


def expert_owner(expert: torch.Tensor, n_experts: int, ep: int) -> torch.Tensor:
    """The ep rank that owns each expert id."""
    return expert // (n_experts // ep)


# ---------------------------------------------------------------------------------------------------------------
# The all-to-all as an autograd function
# ---------------------------------------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """Rows in_splits[j] to rank j forward; backward sends each row's gradient back where the row came from.

    With `pending` (a list: an autograd function returns tensors only), the forward only starts the exchange: it
    returns the output buffer at once and appends the handle; the caller waits on it before reading the rows."""

    @staticmethod
    def forward(ctx, x, comm, in_splits, out_splits, pending):
        ctx.comm, ctx.in_splits, ctx.out_splits = comm, in_splits, out_splits
        if pending is None:
            return comm.all_to_all(x, in_splits=in_splits, out_splits=out_splits)
        handle = comm.all_to_all(x, in_splits=in_splits, out_splits=out_splits, async_op=True)
        pending.append(handle)
        return handle.output

    @staticmethod
    def backward(ctx, grad):
        back = ctx.comm.all_to_all(grad.contiguous(), in_splits=ctx.out_splits, out_splits=ctx.in_splits)
        return back, None, None, None, None


def all_to_all(x: torch.Tensor, comm: Comm, in_splits: list[int], out_splits: list[int]) -> torch.Tensor:
    """Differentiable uneven all-to-all of the rows of x over `comm` (the ledger records both directions)."""
    return _AllToAll.apply(x, comm, in_splits, out_splits, None)


def start_all_to_all(x: torch.Tensor, comm: Comm, in_splits: list[int],
                     out_splits: list[int]) -> tuple[torch.Tensor, Handle]:
    """`all_to_all` that returns at once: (output buffer, handle). Read the output only after `handle.wait()`."""
    pending: list[Handle] = []
    out = _AllToAll.apply(x, comm, in_splits, out_splits, pending)
    return out, pending[0]


def arrival_order(received: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """received [ep, E] (rows from each source rank for each local expert, in arrival order: by source, then by
    expert) -> the permutation that regroups the arrivals by local expert (stable: by source inside an expert).
    `rows`: received.sum() when the caller knows it (the splits are on the host already): repeat_interleave with
    repeats in a tensor otherwise reads their sum on the host to size its output, a stream sync on a GPU."""
    n_sources, n_local = received.shape
    expert_of_row = torch.arange(n_local, device=received.device).repeat(n_sources)
    return torch.argsort(expert_of_row.repeat_interleave(received.flatten(), output_size=rows), stable=True)


# ---------------------------------------------------------------------------------------------------------------
# The module swap
# ---------------------------------------------------------------------------------------------------------------


class ExpertParallelExperts(Experts):
    """This rank's block of a layer's experts, behind the interface of `Experts`: forward(x grouped by expert over
    ALL N experts, counts [N]) -> outputs in the same order. The rows travel to their experts' ranks and back.

    `last_counts` holds the last forward's `counts` (this rank's row of the count matrix of `expected_ep_bytes`)."""

    def __init__(self, full: Experts, comm: Comm) -> None:
        n_experts = full.w1.shape[0]
        mine = local_experts(n_experts, comm.size, comm.rank)
        nn.Module.__init__(self)  # skip Experts' allocation: the weights are this rank's slices of `full`'s
        self.backend, self.comm, self.n_experts = full.backend, comm, n_experts
        split = Split(dim=0, index=comm.rank, parts=comm.size, replicas=1)
        for name in ("w1", "w3", "w2"):
            weight = getattr(full, name)
            local = nn.Parameter(weight.detach()[mine.start:mine.stop].clone(), requires_grad=weight.requires_grad)
            local.placement = placement_of(weight)  # keep what earlier steps (tensor parallel) recorded
            set_split(local, "ep", split, weight.shape)
            setattr(self, name, local)
        self.last_counts: torch.Tensor | None = None

    @torch.compiler.disable  # see below
    def forward(self, x: torch.Tensor, counts: torch.Tensor, padded: bool = False) -> torch.Tensor:
        """Never traced by torch.compile (an eager call inside a compiled block): the all-to-all's splits are
        data read on the host, and every row count they give is a new shape; traced, they were recompiles."""
        ep, me, n_local = self.comm.size, self.comm.rank, self.n_experts // self.comm.size
        by_rank = counts.view(ep, n_local)
        received = self.comm.all_to_all(by_rank.contiguous())  # [ep, n_local]: row j from rank j
        self.last_counts = counts.detach().clone()
        send, recv = by_rank.sum(1).tolist(), received.sum(1).tolist()  # the splits: a host sync, as in Megatron
        if padded:  # the dropped slots after the grouped rows do not travel; their outputs are zeros
            tail, x = x[sum(send):], x[:sum(send)]
        # This rank's own rows for its own experts never travel: they are the contiguous slice [start, stop) of x.
        # Start the exchange of the others, compute the own rows while they travel, then the arrivals.
        start, stop = sum(send[:me]), sum(send[:me + 1])
        send[me] = recv[me] = 0
        arrived, in_flight = start_all_to_all(torch.cat([x[:start], x[stop:]]), self.comm, send, recv)
        own = super().forward(x[start:stop], by_rank[me])
        in_flight.wait()
        received[me] = 0  # the own rows did not arrive: they are `own`
        order = arrival_order(received, sum(recv))
        y = super().forward(arrived[order], received.sum(0))
        if y.shape[0] == 0:  # no rows here: stay in the graph, so this rank joins the backward all-to-alls too
            y = arrived * 0
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        back = all_to_all(y[inverse], self.comm, recv, send)
        return torch.cat([back[:start], own, back[start:]] + ([torch.zeros_like(tail)] if padded else []))


def is_expert_param(param: torch.Tensor) -> bool:
    """Whether a parameter is split over the experts (its placement has an "ep" split along a dimension)."""
    split = placement_of(param).splits.get("ep")
    return split is not None and split.dim is not None


def apply_expert_parallel(model: nn.Module, comm: Comm) -> nn.Module:
    """Swap every MoE layer's experts for this rank's block of them (in place; returns the model).

    Every parameter then records its "ep" split: an expert weight holds slice `comm.rank` of `comm.size` along the
    expert dimension; every other parameter is whole, with one copy on each ep rank (so a norm that sums over ep
    divides it by ep)."""
    if comm.size == 1:
        return model
    for layer in moe_layers(model):
        layer.experts = ExpertParallelExperts(layer.experts, comm)
    whole = Split(dim=None, index=0, parts=1, replicas=comm.size)
    for param in model.parameters():
        if "ep" not in placement_of(param).splits:
            set_split(param, "ep", whole, param.shape)
    return model


def expected_ep_bytes(counts: torch.Tensor, n_experts: int, rank: int, d_model: int, element_size: int = 4,
                      backward: bool = True) -> int:
    """Bytes one MoE layer's forward (+ backward) sends from ep rank `rank`, from the count matrix counts [ep, N]
    (row j: the slots rank j routed to each expert, after capacity).

    send[j] = Σ_{e on rank j} counts[rank, e] rows leave for rank j; recv[j] = Σ_{e on rank} counts[j, e] arrive.
    Forward: the counts exchange ((ep − 1) · N/ep int64), the dispatch (the rows sent to other ranks) and the
    combine (the rows received from other ranks, sent back). Backward repeats dispatch and combine in reverse:

        bytes = 8 · (ep − 1) · N/ep + (1 + backward) · (Σ_{j≠r} send[j] + Σ_{j≠r} recv[j]) · d_model · element_size
    """
    ep = counts.shape[0]
    owner = expert_owner(torch.arange(n_experts, device=counts.device), n_experts, ep)
    send = torch.zeros(ep, dtype=torch.long, device=counts.device).index_add(0, owner, counts[rank].long())
    recv = counts[:, owner == rank].long().sum(1)
    rows = int(send.sum() - send[rank] + recv.sum() - recv[rank])
    return 8 * (ep - 1) * (n_experts // ep) + (1 + int(backward)) * rows * d_model * element_size
