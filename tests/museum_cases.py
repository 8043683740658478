"""Chapter 14's multi-process cases, run in ONE 2-rank launch per test session: every museum bug switched on and
off in its layout, and the tolerance lab's layouts (dp 2, tp 2, pp 2) in fp32 and bf16; plus the one-process
references (this process). Rank processes import this module too, so it stays free of pytest."""

from __future__ import annotations

import functools

from minidist.debug import museum
from minidist.debug import parity_run as pr
from minidist.parallel import Layout

BUG_STEPS = 2  # the first step's gradients and norm, and the replica check after a second update
LAB_STEPS = 3
LAB = {"dp2": Layout.of(dp=2), "tp2": Layout.of(tp=2), "pp2": Layout.of(pp=2, microbatches=2)}
DTYPES = ("fp32", "bf16")


def setups() -> list[pr.Setup]:
    out = []
    for name, exhibit in museum.BUGS.items():
        out.append(pr.Setup(exhibit.layout, steps=BUG_STEPS, bug=name, label=name))
        out.append(pr.Setup(exhibit.layout, steps=BUG_STEPS, label=f"{name} off"))
    for dtype in DTYPES:
        out += [pr.Setup(layout, steps=LAB_STEPS, dtype=dtype, label=f"{label} {dtype}")
                for label, layout in LAB.items()]
    return out


@functools.lru_cache(maxsize=1)
def results() -> dict[str, dict]:
    """{label: merged record} of every setup (one launch, 2 ranks, one thread each)."""
    chosen = setups()
    return {s.label: record for s, record in zip(chosen, pr.run_many(chosen, timeout=300))}


@functools.lru_cache(maxsize=8)
def reference(dtype: str, steps: int, microbatches: int = 1, reverse: bool = False) -> dict:
    """The one-process run (or, with microbatches/reverse, one process accumulating in another order)."""
    return pr.run_local(pr.Setup(Layout.of(microbatches=microbatches), steps=steps, dtype=dtype, reverse=reverse))
