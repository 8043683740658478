"""Chapter 14 exercises: localize a bug with a layer-by-layer gradient diff; compare a ledger with its formulas.

Grade your answers with `make grade CH=14`. The grader checks:
  - first_flagged on gradients of the chapter's tiny model: None within the tolerance; the first flagged parameter
    in the reference's (model) order, not the order of `got`; the error relative to the reference's norm; a
    missing parameter flagged with an infinite error; every museum bug's diff pointing where its exhibit says;
  - ledger_diff on real `minidist.comm.communicator.Ledger` totals: [] when bytes match the formulas; each mismatch as
    (op, group, measured, expected) in sorted order, an operation the formulas do not expect (expected 0) and one
    that never happened (measured 0) included.
"""

import math

import torch


def first_flagged(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> tuple[str, float] | None:
    """The first parameter, in `want`'s order, whose gradient differs from the reference by more than `tol`."""
    for name, ref in want.items():
        if name not in got or got[name].shape != ref.shape:
            return name, math.inf
        ref = ref.double()
        err = (got[name].double() - ref).norm().item()
        scale = ref.norm().item()
        rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
        if rel > tol:
            return name, rel
    return None


def ledger_diff(totals: dict[tuple[str, str], dict[str, int]],
                expected: dict[tuple[str, str], int]) -> list[tuple[str, str, int, int]]:
    """Every (op, group) whose measured bytes differ from the formula's, as (op, group, measured, expected)."""
    keys = sorted(set(totals) | set(expected))
    rows = [(op, group, totals.get((op, group), {}).get("bytes", 0), expected.get((op, group), 0))
            for op, group in keys]
    return [row for row in rows if row[2] != row[3]]
