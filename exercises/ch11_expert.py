"""Chapter 11 exercises: the bookkeeping of an expert-parallel dispatch — who sends how many rows to whom, the
permutation that puts a rank's slots in destination order, its inverse, and the regrouping of what arrives.

Grade your answers with `make grade CH=11`. The grader runs the chapter's example (2 ep ranks, 4 experts, top-2,
6 tokens per rank) and random cases, compares with `minidist.parallel.ep.expert` where it has an answer, and checks
the properties that define each answer (a permutation, sorted, stable, an inverse).

Conventions, as in `minidist.parallel.ep.expert`: N experts over ep ranks in contiguous blocks, so rank r owns experts
[r·N/ep, (r+1)·N/ep); a *slot* is one (token, choice) pair, i.e. one row that travels; `experts` [S] (int64) holds
the expert id of each of a rank's S slots.
"""

import torch


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

    Hints: torch.arange(E).repeat(ep).repeat_interleave(received.flatten()) labels every arrival with its local
    expert; then a stable argsort. Its inverse (the exercise above) puts the experts' outputs back in arrival
    order for the combine.
    """
    raise NotImplementedError("exercise: label each arrival with its local expert, then a stable argsort")
