"""Chapter 14 exercises: localize a bug with a layer-by-layer gradient diff; compare a ledger with its formulas;
a tolerance derived from Higham's bound (answers).

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


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's γ_n (see exercises/ch14_debugging.py)."""
    u = torch.finfo(dtype).eps / 2  # unit roundoff of round-to-nearest
    if n * u >= 1:
        raise ValueError(f"gamma_n needs n·u < 1; n = {n} with u = {u:.3g} gives {n * u:.3g}")
    return n * u / (1 - n * u)


def dot_error_bound(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> float:
    """γ_n Σ|x_i y_i| (see exercises/ch14_debugging.py)."""
    return gamma(x.numel(), dtype) * (x.double().abs() * y.double().abs()).sum().item()


def reordered_matmul_tolerance(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """2 γ_n |A||B| (see exercises/ch14_debugging.py)."""
    return 2 * gamma(a.shape[1], dtype) * (a.double().abs() @ b.double().abs())
