"""Chapter 11 exercises: the bookkeeping of an expert-parallel dispatch — who sends how many rows to whom, the
permutation that puts a rank's slots in destination order, its inverse, and the regrouping of what arrives.

The last three exercises run the whole dispatch on real ranks: an all-to-all that autograd can differentiate, and
the dispatch and combine built from it.

Grade your answers with `make grade CH=11`. The grader runs the chapter's example (2 ep ranks, 4 experts, top-2,
6 tokens per rank) and random cases, compares with `minidist.parallel.ep.expert` where it has an answer, and checks
the properties that define each answer (a permutation, sorted, stable, an inverse).

Conventions, as in `minidist.parallel.ep.expert`: N experts over ep ranks in contiguous blocks, so rank r owns experts
[r·N/ep, (r+1)·N/ep); a *slot* is one (token, choice) pair, i.e. one row that travels; `experts` [S] (int64) holds
the expert id of each of a rank's S slots.
"""

import torch
import torch.distributed as dist  # noqa: F401  (the last three exercises run on real ranks)


def send_counts(experts: torch.Tensor, n_experts: int, ep: int) -> torch.Tensor:
    """How many rows this rank sends to each of the ep ranks: an int64 tensor [ep] summing to S.

    experts [S]: the expert id of each slot this rank dispatches (after any capacity dropping). A slot travels to
    the rank that owns its expert. With the chapter's example (N = 4, ep = 2: experts 0, 1 on rank 0, experts 2, 3
    on rank 1), rank 0's slots choose experts [0, 3, 2, 0, 2, 3, 2, 1, 3, 1, 0, 2]: it sends 5 rows to itself and 7
    to rank 1, so the answer is [5, 7].

    These are the `in_splits` of the dispatch all-to-all: the rows for rank 0 first, then rank 1's, and so on.
    Hints: the owner of expert e is e // (N / ep) (contiguous blocks, not e % ep); torch.bincount with
    minlength=ep counts every rank, even one that gets nothing.
    """
    raise NotImplementedError("exercise: the owner of each slot's expert, counted per rank")


def receive_counts(count_matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """How many rows `rank` receives from each of the ep ranks: an int64 tensor [ep].

    count_matrix [ep, N]: row j holds the slots rank j routes to each expert — what the counts exchange (an
    all-to-all of N small integers per rank, before the dispatch) tells every rank about the others. A rank cannot
    know this without that exchange: the rows coming to it depend on every other rank's router.

    `rank` receives, from rank j, the slots j routes to `rank`'s own experts. In the chapter's example the matrix
    is [[3, 2, 4, 3], [4, 3, 2, 3]]: rank 0 owns experts 0 and 1, so it receives [3 + 2, 4 + 3] = [5, 7].
    These are the `out_splits` of the dispatch. Note what they are not: row `rank` summed by blocks is what
    `rank` *sends*.
    """
    raise NotImplementedError("exercise: the column block of rank's experts, summed per source rank")


def destination_order(experts: torch.Tensor, n_experts: int, ep: int) -> torch.Tensor:
    """The permutation that sorts a rank's slots by destination rank, and inside one destination by expert, stably:
    an int64 tensor [S].

    `experts[order]` then lists the slots for rank 0 first, then those for rank 1, ..., as the all-to-all wants its
    input (contiguous blocks of send_counts rows), and inside each block the slots of the destination's first
    local expert come first: the receiver gets its rows grouped by source, then by its local expert, which is what
    the counts exchange describes. Slots for the same expert keep their original order (a *stable* sort: every
    rank and every rerun must agree on which row is which).

    Because experts sit in contiguous blocks, sorting by expert id sorts by destination too; chapter 06's dispatch
    already does exactly this sort (`plan_dispatch`), so minidist gets the order for free.
    Hint: torch.argsort(..., stable=True).
    """
    raise NotImplementedError("exercise: a stable argsort by (destination rank, expert)")


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """The permutation `inverse` [S] with inverse[order[i]] = i, so that x[order][inverse] = x.

    After the combine all-to-all, the outputs come back in the order the rows left (destination order); the
    inverse puts them back in the slots' original order. Build it in O(S) without sorting: scatter
    arange(S) into the positions order names (or, in O(S log S), argsort(order)). Note order[order] is not it.
    """
    raise NotImplementedError("exercise: scatter arange(S) to the positions order lists")


def local_expert_order(received: torch.Tensor) -> torch.Tensor:
    """The permutation that regroups a rank's arrived rows by local expert, stably: an int64 tensor [R].

    received [ep, E]: rows that arrive from each source rank for each of this rank's E local experts (row j of
    the counts exchange, restricted to its experts). The all-to-all delivers them grouped by source, then by
    expert: from rank 0 its rows for local expert 0, then for local expert 1, ...; then rank 1's. The local
    experts want one contiguous run each, so sort by local expert; inside one expert keep the arrival order
    (source rank 0's rows first). In the chapter's example rank 0 receives [[3, 2], [4, 3]]: local experts of the
    12 arrivals [0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1], so the order is [0, 1, 2, 5, 6, 7, 8, 3, 4, 9, 10, 11].

    Hints: first write down, for every arrival, which local expert it is for — the counts say how long each run
    of equal labels is, and in which order the runs come. Then you need an order that groups equal labels without
    reordering arrivals inside a group. Its inverse (the exercise above) puts the experts' outputs back in arrival
    order for the combine.
    """
    raise NotImplementedError("exercise: label each arrival with its local expert, then a stable argsort")


def all_to_all_rows(x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
    """An uneven all-to-all of rows over the default process group that autograd can differentiate.

    x [sum(send), ...]: the first send[0] rows go to rank 0, the next send[1] to rank 1, and so on; return
    [sum(recv), ...]: the recv[j] rows rank j sent here, in rank order. Every rank calls it, each with its own
    counts (rank i's send[j] equals rank j's recv[i]).

    Forward is one dist.all_to_all_single with split sizes. Write it as a torch.autograd.Function: the gradient of
    the received rows has to travel back to the rank each row came from. Which collective moves it there, and
    with which split sizes? (Chapter 10, §5 and chapter 11, §3: the adjoint of a permutation of rows across ranks.)
    Gradients of the split sizes: none (return None for them).
    """
    raise NotImplementedError("exercise: an autograd Function around an uneven all_to_all_single")


def dispatch(x: torch.Tensor, experts: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Send each of this rank's rows to the rank that owns its expert; return (received, local_expert, state).

    x [S, d]: one row per slot; experts [S]: each slot's expert id (contiguous blocks of n_experts / ep experts per
    rank, ep = world size). `received` [R, d] is every row, from every rank, whose expert lives here, in arrival
    order (source rank 0's rows first; from one source, by expert, then in the source's slot order);
    `local_expert` [R] is each arrival's expert index on this rank (0 ≤ e < n_experts / ep); `state` is whatever
    combine() needs to send the outputs home (it is yours: the grader only passes it back).

    A rank cannot know R, nor how the rows it receives split over its experts, from its own router: something has
    to be exchanged before the rows move. Use your answers above and all_to_all_rows, so gradients flow to x.
    """
    raise NotImplementedError("exercise: sort by destination, exchange the counts, all-to-all the rows")


def combine(y: torch.Tensor, state: object) -> torch.Tensor:
    """Send the experts' outputs y [R, d'] (one per row `dispatch` delivered, same order) back to the ranks the
    rows came from, and return them in this rank's original slot order: [S, d'], row i the output for slot i.

    Graded end to end: out = combine(y, state) with y_i = received_i @ W[local_expert_i] must equal the one-device
    layer x_i @ W[experts_i] on every rank, and the gradients of x and of every expert's W must equal the
    one-device gradients (the graders sum the gradient over all slots of all ranks for W).
    """
    raise NotImplementedError("exercise: the reverse all-to-all, then undo the destination sort")
