"""The one description of a parallel layout (minidist.parallel.layout): built from flat settings, given back flat,
its derived figures, and one-line errors for settings it does not know."""

from __future__ import annotations

import pytest

from minidist.comm.topology import ParallelDims
from minidist.parallel import Layout, ParallelOptions


def test_flat_settings_land_in_their_records() -> None:
    layout = Layout.of(dp=2, tp=4, ep=2, zero=1, sequence_parallel=True, microbatches=4, recompute="full")
    assert layout.dims == ParallelDims(dp=2, tp=4, ep=2)
    assert layout.options == ParallelOptions(sequence_parallel=True, microbatches=4, zero=1)
    assert layout.recompute == "full"
    assert Layout.of(**layout.flat()) == layout == Layout.of(**layout.changes())
    assert layout.changes() == dict(dp=2, tp=4, ep=2, sequence_parallel=True, microbatches=4, zero=1, recompute="full")
    assert repr(Layout.of(dp=2, microbatches=2)) == "Layout.of(dp=2, microbatches=2)"
    assert Layout.of() == Layout() and Layout().changes() == {}


def test_derived_figures() -> None:
    layout = Layout.of(dp=4, tp=2, pp=2, cp=2, ep=4, sequence_parallel=True)
    assert layout.world_size == 32
    assert layout.sp_degree == 2 and Layout.of(tp=2).sp_degree == 1
    assert layout.replicas == {"dense": 8, "experts": 2}


@pytest.mark.parametrize("flat, words", [
    (dict(dp=2, sp=True), "unknown layout setting 'sp'; known: dp, tp, pp, cp, ep, sequence_parallel"),
    (dict(recompute="some"), "recompute must be one of none, selective, full, got 'some'"),
    (dict(dp=2, ep=4), "ep=4 does not divide dp*cp=2"),
])
def test_bad_settings_are_one_line_errors(flat: dict, words: str) -> None:
    with pytest.raises(ValueError) as info:
        Layout.of(**flat)
    assert words in str(info.value) and "\n" not in str(info.value)
