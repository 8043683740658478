"""What the chapter graders share: load a function from the package being graded (`--impl`), turn a stub's
NotImplementedError into a one-line failure instead of a traceback, and name the likely cause of a wrong count."""

import importlib
from collections.abc import Callable

import pytest


def load(impl: str, module: str, name: str) -> Callable:
    """`impl.module.name`, wrapped so that calling an unanswered stub fails the test with a readable message."""
    fn = getattr(importlib.import_module(f"{impl}.{module}"), name)

    def call(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotImplementedError:
            pass  # fail outside the except block, so the report shows no chained traceback
        pytest.fail(f"{impl}.{module}.{name} is not implemented yet", pytrace=False)

    return call


def explain(diff: float, missing: dict[str, float], extra: dict[str, float] | None = None) -> str:
    """A hint for a count that is off by `diff` (got − expected).

    `missing` lists pieces an answer may have left out (they explain diff < 0), `extra` pieces it may have counted
    although they do not belong (diff > 0); a piece whose size equals |diff| is named.
    """
    candidates = missing if diff < 0 else (extra if extra is not None else missing)
    names = [name for name, size in candidates.items() if size and abs(abs(diff) - size) <= 1e-9 * size]
    if not names:
        return ""
    if diff < 0:
        return f" ({-diff:,.0f} short) — did you leave out " + ", or ".join(names) + "?"
    return f" ({diff:,.0f} too many) — did you count " + ", or ".join(names) + "?"
