"""Chapter 14 exercises: localize a bug with a layer-by-layer gradient diff; compare a ledger with its formulas.

Grade your answers with `make grade CH=14`. The grader checks:
  - first_flagged on gradients of the chapter's tiny model: None within the tolerance; the first flagged parameter
    in the reference's (model) order, not the order of `got`; the error relative to the reference's norm; a
    missing parameter flagged with an infinite error; every museum bug's diff pointing where its exhibit says;
  - ledger_diff on real `minidist.comm.communicator.Ledger` totals: [] when bytes match the formulas; each mismatch as
    (op, group, measured, expected) in sorted order, an operation the formulas do not expect (expected 0) and one
    that never happened (measured 0) included.
"""

import torch


def first_flagged(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> tuple[str, float] | None:
    """The first parameter, in `want`'s order, whose gradient differs from the reference by more than `tol`.

    `want` is the one-process run's gradients by parameter name, in model order (the embedding first, the head
    last); `got` is a parallel run's full gradients by the same names (gathered from shards), in any order. For
    each name compute rel = ||got − want||₂ / ||want||₂ (in float64; 0 if both are zero, inf if only the reference
    is zero). Return (name, rel) for the first name whose rel exceeds `tol`, or None if none does. A name missing
    from `got`, or with another shape, counts as (name, inf): a shard that was never gathered is a finding too.

    Why the first in model order, and not the largest? A bug in layer L changes the forward from L on and the
    backward of everything before it, so many parameters differ; reading in a fixed order makes every rank and
    every run report the same one, and the diff's table then shows the size of each (chapter 14, §2).

    Hints: iterate over want.items(); torch.Tensor.norm(); math.inf.
    """
    raise NotImplementedError


def ledger_diff(totals: dict[tuple[str, str], dict[str, int]],
                expected: dict[tuple[str, str], int]) -> list[tuple[str, str, int, int]]:
    """Every (op, group) whose measured bytes differ from the formula's, as (op, group, measured, expected).

    `totals` is `minidist.comm.communicator.Ledger.totals()`: {(op, group): {"calls": c, "bytes": b}} for every
    operation that ran; `expected` is {(op, group): bytes} from the chapter's formulas. Compare over the union of both
    key sets (an operation the formulas do not list expected 0 bytes; one that never ran measured 0) and return the
    mismatching rows sorted by (op, group); [] when the ledger agrees with every formula. A data-parallel run whose
    gradient all-reduce never happened (the museum's no_sync bug) shows up as ("all_reduce", "dp_cp", 0, N).

    Hints: sorted(set(a) | set(b)); dict.get with a default.
    """
    raise NotImplementedError
