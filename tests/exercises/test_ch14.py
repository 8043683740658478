"""Grade chapter 14's exercises: the first flagged layer of a gradient diff, and a ledger against its formulas.

`pytest tests/exercises -k ch14` grades solutions/ (the default); add `--impl exercises` to grade your own answers
(`make grade CH=14`). The oracles: the chapter's tiny model's gradients with a difference placed here, the museum's
bugs (each with the parameters it must be localized to), and a real Ledger filled here with known bytes.
"""

import math

import pytest
import torch
from grading import load

from minidist.comm.communicator import Ledger
from minidist.debug import museum, tolerance
from minidist.debug import parity_run as pr

MODULE = "ch14_debugging"


@pytest.fixture(scope="module")
def grads() -> dict[str, torch.Tensor]:
    return pr.run_local(pr.Setup())["grads"]


def test_ch14_first_flagged(impl: str, grads: dict[str, torch.Tensor]) -> None:
    first_flagged = load(impl, MODULE, "first_flagged")
    tol = tolerance.rel_tol("fp32", 1)
    names = list(grads)
    assert first_flagged(dict(grads), grads, tol) is None, "first_flagged: identical gradients must give None"
    got = {name: grads[name].clone() for name in reversed(names)}  # the reference's order decides, not got's
    last, middle = names[-1], names[len(names) // 2]
    got[last] = got[last] * 2
    got[middle] = got[middle] + 0.01 * got[middle].norm() / math.sqrt(got[middle].numel())
    found = first_flagged(got, grads, tol)
    assert found is not None and found[0] == middle, f"first_flagged: expected {middle} (model order), got {found}"
    assert found[1] == pytest.approx(0.01 * grads[middle].norm().item() / grads[middle].norm().item(), rel=1e-3), (
        f"first_flagged: rel must be ||got - want|| / ||want||, got {found[1]}")
    del got[middle]
    assert first_flagged(got, grads, tol) == (middle, math.inf), "first_flagged: a missing gradient is (name, inf)"


def test_ch14_first_flagged_finds_each_museum_bug(impl: str) -> None:
    """The museum's one-process-vs-2-ranks records for two gradient bugs, built here on 2 ranks."""
    first_flagged = load(impl, MODULE, "first_flagged")
    reference = pr.run_local(pr.Setup())
    names = ("pipeline_missing_1_over_m", "token_vs_sample_mean")
    setups = [pr.Setup(museum.BUGS[n].layout, bug=n, label=n) for n in names]
    for name, record in zip(names, pr.run_many(setups)):
        want = museum.expected_layer(name, list(reference["grads"]))[0]
        found = first_flagged(record["grads"], reference["grads"], tolerance.rel_tol("fp32", 1))
        assert found is not None and found[0] == want, f"first_flagged on {name}: expected {want}, got {found}"


def test_ch14_ledger_diff(impl: str) -> None:
    ledger_diff = load(impl, MODULE, "ledger_diff")
    ledger = Ledger()
    ledger.record("all_reduce", "dp_cp", 1000)
    ledger.record("all_reduce", "tp", 64, calls=4)
    ledger.record("all_gather", "tp", 32)
    expected = {("all_reduce", "dp_cp"): 1000, ("all_reduce", "tp"): 64, ("all_gather", "tp"): 32}
    assert ledger_diff(ledger.totals(), expected) == [], "ledger_diff: a ledger equal to its formulas gives []"
    expected[("all_reduce", "dp_cp")] = 1200
    expected[("reduce_scatter", "dp_cp")] = 500
    del expected[("all_gather", "tp")]
    got = ledger_diff(ledger.totals(), expected)
    want = [("all_gather", "tp", 32, 0), ("all_reduce", "dp_cp", 1000, 1200), ("reduce_scatter", "dp_cp", 0, 500)]
    assert got == want, f"ledger_diff: expected {want} (sorted; missing sides count 0 bytes), got {got}"
