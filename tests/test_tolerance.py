"""The tolerance rule (chapter 14): an upper bound of what reduction order alone changes (measured afresh on
dp 2, tp 2, pp 2 and reversed micro-batches, fp32 and bf16), and below every museum bug."""

from __future__ import annotations

import museum_cases
import pytest

from minidist.debug import museum, tolerance

LAB = [f"{layout} {dtype}" for dtype in museum_cases.DTYPES for layout in museum_cases.LAB]


def _within_rule(errors: dict, dtype: str) -> None:
    assert errors["grad"] <= tolerance.rel_tol(dtype, 1), errors
    for step, (loss, norm) in enumerate(zip(errors["loss"], errors["norm"]), start=1):
        bound = tolerance.rel_tol(dtype, step)
        assert loss <= bound and norm <= bound, (step, loss, norm, bound)


@pytest.mark.parametrize("label", LAB)
def test_layouts_differ_from_one_process_by_less_than_the_rule(label: str) -> None:
    dtype = label.split()[-1]
    reference = museum_cases.reference(dtype, museum_cases.LAB_STEPS)
    errors = tolerance.measure(museum_cases.results()[label], reference)
    _within_rule(errors, dtype)
    assert errors["grad"] > 0, f"{label}: bitwise equal gradients: this layout reorders nothing to measure"


@pytest.mark.parametrize("dtype", museum_cases.DTYPES)
def test_reversed_micro_batches_differ_by_less_than_the_rule(dtype: str) -> None:
    steps = museum_cases.LAB_STEPS
    errors = tolerance.measure(museum_cases.reference(dtype, steps, microbatches=4, reverse=True),
                               museum_cases.reference(dtype, steps))
    _within_rule(errors, dtype)


@pytest.mark.parametrize("name", list(museum.BUGS))
def test_every_museum_bug_is_larger_than_the_rule(name: str) -> None:
    reference = museum_cases.reference("fp32", museum_cases.BUG_STEPS)
    report = museum.localize(name, museum_cases.results()[name], reference)
    assert report.largest is not None and report.largest.rel > 10 * tolerance.rel_tol("fp32", 1), report.summary()


def test_the_rule_grows_with_steps_and_knows_its_dtypes() -> None:
    one = tolerance.rel_tol("fp32", 1)
    assert tolerance.rel_tol("fp32", 3) == pytest.approx(3 * one)
    assert tolerance.rel_tol("bf16", 1) > 1000 * one  # 2^16 times coarser eps, K of its own
    assert tolerance.close([1 + 0.9 * one, 1 + 1.9 * one], [1.0, 1.0])  # step 2 may differ by twice as much
    assert not tolerance.close([1 + 1.1 * one], [1.0])
    with pytest.raises(ValueError, match="no measured tolerance for dtype 'fp16'"):
        tolerance.rel_tol("fp16")
