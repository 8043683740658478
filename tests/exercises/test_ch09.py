"""Grade chapter 09's exercises: the 1F1B schedule and the breadth-first (looped) schedule, as data.

`pytest tests/exercises -k ch09` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
The oracle is the chapter's simulator, `minidist.parallel.pp.schedules.simulate` (deadlocks, compute before its input)
with `check_complete`, and the chapter's formulas: bubble (p−1)/(m+p−1) for 1F1B and (p−1)/(v·m+p−1) breadth-first,
step time, micro-batches in flight per rank. Calling or importing minidist's own schedule builders is refused.
"""

import importlib
from contextlib import contextmanager

import pytest

from minidist.parallel.pp import schedules as S

MODULE = "ch09_pipeline_schedules"
BUILDERS = ("build_schedule", "afab_order", "one_f_one_b_order", "interleaved_order", "with_communication",
            "forward_only")
COSTS = [(1.0, 2.0), (1.0, 1.0), (2.0, 3.0)]  # (t_f, t_b) of one micro-batch on one rank, all chunks together


class Refused(AssertionError):
    """The answer called one of minidist's schedule builders."""


@contextmanager
def _own_work_only(module):
    """Make minidist's schedule builders raise while the answer runs, and refuse an answer that imported them."""
    originals = {name: getattr(S, name) for name in BUILDERS}
    imported = [name for name, value in vars(module).items() if any(value is f for f in originals.values())]
    if imported:
        pytest.fail(f"{module.__name__} imports {imported} from minidist.parallel.pp.schedules: "
                    "build the lists yourself", pytrace=False)

    def refuse(name):
        def call(*args, **kwargs):
            raise Refused(f"minidist.parallel.pp.schedules.{name} builds the schedule for you: write your own")
        return call

    try:
        for name in BUILDERS:
            setattr(S, name, refuse(name))
        yield
    finally:
        for name, original in originals.items():
            setattr(S, name, original)


def _build(impl: str, name: str, *args: int) -> list[list[S.Action]]:
    module = importlib.import_module(f"{impl}.{MODULE}")
    with _own_work_only(module):
        try:
            schedule = getattr(module, name)(*args)
        except NotImplementedError:
            pytest.fail(f"{impl}.{MODULE}.{name} is not implemented yet", pytrace=False)
        except Refused as error:
            pytest.fail(f"{impl}.{MODULE}.{name}{args}: {error}", pytrace=False)
    return schedule


def _in_flight(order: list[S.Action]) -> int:
    """The most (micro-batch, chunk) units whose forward has run and whose backward has not."""
    live = peak = 0
    for a in order:
        if a.kind in S.COMPUTE:
            live += 1 if a.kind == S.F else -1
            peak = max(peak, live)
    return peak


def _check_structure(schedule, pp: int, m: int, v: int, where: str) -> None:
    """Shape, completeness, and every message sent once after its compute and received once."""
    assert isinstance(schedule, list) and len(schedule) == pp, f"{where}: expected a list of {pp} lists (one per rank)"
    for r, order in enumerate(schedule):
        bad = [a for a in order if not isinstance(a, S.Action)]
        assert not bad, f"{where}: rank {r} holds {bad[:2]}, not minidist.parallel.pp.schedules.Action"
    try:
        S.check_complete(schedule, pp, m, v)
    except ValueError as error:
        pytest.fail(f"{where}: {error}", pytrace=False)
    last = pp * v - 1
    produced_by = {S.SEND_F: S.F, S.SEND_B: S.B}
    for r, order in enumerate(schedule):
        seen = set()
        for a in order:
            if a.kind in produced_by:
                assert S.Action(produced_by[a.kind], a.mb, a.chunk) in seen, (
                    f"{where}: rank {r} sends {a} before running {produced_by[a.kind]}{a.mb} on chunk {a.chunk}, "
                    "which produces that message")
            assert S.chunk_rank(a.chunk, pp) == r, f"{where}: {a} is on rank {r}, but chunk {a.chunk} is not"
            seen.add(a)
    messages = [a for order in schedule for a in order if a.kind not in S.COMPUTE]
    want = {S.SEND_F: m * last, S.RECV_F: m * last, S.SEND_B: m * last, S.RECV_B: m * last}
    for kind, n in want.items():
        got = [a for a in messages if a.kind == kind]
        assert len(got) == len(set(got)) == n, (
            f"{where}: {len(got)} {kind} actions ({len(got) - len(set(got))} repeated), expected {n}: one per "
            f"micro-batch and chunk boundary (m = {m} micro-batches x {last} boundaries)")


def _simulate(schedule, t_f: float, t_b: float, where: str) -> S.Timeline:
    try:
        return S.simulate(schedule, t_f, t_b)
    except ValueError as error:
        pytest.fail(f"{where}: the simulator refuses the schedule: {error}", pytrace=False)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
def test_ch09_one_f_one_b(impl: str, pp: int) -> None:
    for m in range(1, 10):
        where = f"one_f_one_b_schedule(pp={pp}, microbatches={m})"
        schedule = _build(impl, "one_f_one_b_schedule", pp, m)
        _check_structure(schedule, pp, m, 1, where)
        peaks = [_in_flight(order) for order in schedule]
        bound = [min(pp - r, m) for r in range(pp)]
        assert all(a <= b for a, b in zip(peaks, bound)), (
            f"{where}: micro-batches in flight per rank {peaks}, 1F1B holds at most min(p−r, m) = {bound} — after "
            "p−r−1 warm-up forwards, every forward must be followed by a backward")
        for t_f, t_b in COSTS:
            timeline = _simulate(schedule, t_f, t_b, where)
            want = (m + pp - 1) * (t_f + t_b)
            assert abs(timeline.makespan - want) < 1e-9, (
                f"{where}, t_f={t_f}, t_b={t_b}: the step takes {timeline.makespan:g}, expected (m+p−1)(t_f+t_b) = "
                f"{want:g} — a rank waits longer than the pipeline's fill and drain; is a receive placed too early?")
            formula = (pp - 1) / (m + pp - 1)
            assert abs(timeline.bubble_fraction() - formula) < 1e-12, (
                f"{where}: bubble {timeline.bubble_fraction():.4f}, expected (p−1)/(m+p−1) = {formula:.4f}")


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_ch09_looped_afab(impl: str, pp: int) -> None:
    for v in (1, 2, 3):
        for m in range(pp, pp + 5):
            where = f"looped_afab_schedule(pp={pp}, microbatches={m}, virtual_stages={v})"
            schedule = _build(impl, "looped_afab_schedule", pp, m, v)
            _check_structure(schedule, pp, m, v, where)
            peaks = [_in_flight(order) for order in schedule]
            assert peaks == [m * v] * pp, (
                f"{where}: (micro-batch, chunk) units in flight per rank {peaks}, expected m·v = {m * v} on every rank "
                "(all forwards before any backward)")
            for t_f, t_b in COSTS:
                timeline = _simulate(schedule, t_f / v, t_b / v, where)  # one chunk costs 1/v of a stage
                want = (m + (pp - 1) / v) * (t_f + t_b)
                formula = (pp - 1) / (v * m + pp - 1)
                assert abs(timeline.makespan - want) < 1e-9 and abs(timeline.bubble_fraction() - formula) < 1e-12, (
                    f"{where}, t_f={t_f}, t_b={t_b}: step {timeline.makespan:g}, bubble "
                    f"{timeline.bubble_fraction():.4f}; expected (m+(p−1)/v)(t_f+t_b) = {want:g} and (p−1)/(v·m+p−1) "
                    f"= {formula:.4f} — run every micro-batch through one chunk before the next (forward: chunks in "
                    "order; backward: in reverse), micro-batches in order within a chunk")
