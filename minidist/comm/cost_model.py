"""The α-β cost model of a collective (Hockney; Thakur, Rabenseifner & Gropp 2005), and its fit to timings.

time = α·steps + β·bytes sent per rank: α is the latency each message step pays, β the seconds per byte of one
rank's link. `cost_terms` counts the steps and bytes of each collective on one rank's critical path,
`alpha_beta_time` turns them into seconds, and `fit_alpha_beta` finds α and β from measured timings.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

# The hand-built collectives of minidist.comm.p2p_collectives cost what the algorithm they implement costs.
_ALIASES = {"ring_all_reduce": "all_reduce", "ring_all_gather": "all_gather",
            "ring_reduce_scatter": "reduce_scatter", "pairwise_all_to_all": "all_to_all"}


def cost_terms(op: str, nbytes: float, p: int) -> tuple[float, float]:
    """(steps, bytes) on one rank's critical path for collective `op` on M = `nbytes` over p ranks.

    Every step pays a latency α; every byte a rank sends pays β (one link per rank, full duplex; the reduction's
    arithmetic is ignored). M is the full tensor, as in the ledger.

        all_reduce (ring)   2(p-1) steps, 2(p-1)/p·M     reduce_scatter, all_gather   (p-1), (p-1)/p·M
        naive_all_reduce    2(p-1) steps, 2(p-1)·M       (the root receives p-1 tensors, then sends p-1, one by one)
        broadcast           2(p-1) steps, 2(p-1)/p·M     (scatter then ring all-gather)
        all_to_all          (p-1) steps, (p-1)/p·M       (pairwise exchange)      send   1 step, M
    """
    op = _ALIASES.get(op, op)
    if p < 1:
        raise ValueError(f"p must be >= 1, got {p}")
    if p == 1:
        return 0.0, 0.0
    table = {
        "all_reduce": (2 * (p - 1), 2 * (p - 1) / p),
        "reduce_scatter": (p - 1, (p - 1) / p),
        "all_gather": (p - 1, (p - 1) / p),
        "naive_all_reduce": (2 * (p - 1), 2 * (p - 1)),
        "broadcast": (2 * (p - 1), 2 * (p - 1) / p),
        "all_to_all": (p - 1, (p - 1) / p),
        "send": (1, 1),
    }
    if op not in table:
        raise ValueError(f"no cost model for {op!r}; expected one of {sorted(table) + sorted(_ALIASES)}")
    steps, factor = table[op]
    return float(steps), factor * nbytes


def alpha_beta_time(op: str, nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Predicted seconds: α·steps + β·bytes (see `cost_terms`); α in seconds, β in seconds per byte."""
    steps, sent = cost_terms(op, nbytes, p)
    return alpha * steps + beta * sent


def fit_alpha_beta(samples: Iterable[tuple[str, float, int, float]]) -> tuple[float, float]:
    """Fit (α, β) to measured (op, nbytes, p, seconds) by least squares on the relative error.

    Relative error, because timings span orders of magnitude and a plain fit would ignore the small messages that
    determine α. Both coefficients are kept non-negative (a negative one is set to 0 and the other refitted).
    """
    rows, times = [], []
    for op, nbytes, p, seconds in samples:
        steps, sent = cost_terms(op, nbytes, p)
        rows.append((steps / seconds, sent / seconds))
        times.append(1.0)
    a, y = np.array(rows, dtype=np.float64), np.array(times)
    if len(a) < 2:
        raise ValueError(f"fit_alpha_beta needs at least 2 timings, got {len(a)}")
    (alpha, beta), *_ = np.linalg.lstsq(a, y, rcond=None)
    if alpha < 0 or beta < 0:
        col = 1 if alpha < 0 else 0  # keep only the other term
        coef = float(a[:, col] @ y / (a[:, col] @ a[:, col]))
        alpha, beta = (0.0, coef) if col == 1 else (coef, 0.0)
    return float(alpha), float(beta)
