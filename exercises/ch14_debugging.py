"""Chapter 14 exercises: localize a bug with a layer-by-layer gradient diff; compare a ledger with its formulas;
derive a tolerance from Higham's rounding-error bound instead of fitting one.

Grade your answers with `make grade CH=14`. The grader checks:
  - first_flagged on gradients of the chapter's tiny model: None within the tolerance; the first flagged parameter
    in the reference's (model) order, not the order of `got`; the error relative to the reference's norm; a
    missing parameter flagged with an infinite error; every museum bug's diff pointing where its exhibit says;
  - ledger_diff on real `minidist.comm.communicator.Ledger` totals: [] when bytes match the formulas; each mismatch as
    (op, group, measured, expected) in sorted order, an operation the formulas do not expect (expected 0) and one
    that never happened (measured 0) included;
  - gamma against Higham's definition (unit roundoff u = ε/2, n·u ≥ 1 refused); dot_error_bound and
    reordered_matmul_tolerance against fp32/fp16 products measured here on shapes and data no constant was fitted
    to (random, cancelling, tensor-parallel split sums, reversed order): the bound must hold on every element and
    be the derived one, not a padded guess.
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


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's γ_n = n·u / (1 − n·u) for the dtype's unit roundoff u: the bound on |θ| in
    fl(x₁ + ... + x_n) rounding errors (Higham 2002, "Accuracy and Stability of Numerical Algorithms", §3.1, Lemma
    3.1). Raise ValueError when n·u ≥ 1 (the bound says nothing then).

    Careful with u: fl(a ∘ b) = (a ∘ b)(1 + δ), |δ| ≤ u, and with round-to-nearest u is *half* the machine epsilon
    torch.finfo(dtype).eps (the gap between 1 and the next float).
    """
    raise NotImplementedError("exercise: Higham's gamma_n with the unit roundoff")


def dot_error_bound(x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype) -> float:
    """An upper bound on |fl(xᵀy) − xᵀy| for the dot product of two 1-D vectors computed in `dtype` in any order of
    summation (Higham 2002, §3.1, eq. 3.5).

    Which sum does the bound scale with — the result, or the terms? Think of x·y = 1e4 − 1e4 + 1: the result is 1,
    the rounding errors are those of adding 1e4s. Compute the bound in float64 from x and y as given (they hold
    the values the low-precision computation saw).
    """
    raise NotImplementedError("exercise: gamma_n times the sum of the terms' magnitudes")


def reordered_matmul_tolerance(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The elementwise tolerance [m, p] for comparing two computations of a @ b (a [m, n], b [n, p]) in `dtype` that
    add the n products in different orders — one device's matmul against tensor parallelism's row-split partial
    sums added afterwards, or the same sum reversed.

    Derive it: each computation is within some bound of the exact product, elementwise (the previous exercise, per
    output element). How far apart can two of them be? This is the tolerance a parity test should use for one
    matmul: it grows with n and the dtype's u, and with nothing fitted to a measurement.
    """
    raise NotImplementedError("exercise: a bound per computation, twice")
