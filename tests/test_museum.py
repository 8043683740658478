"""The bug museum (chapter 14): each bug switched on is caught by its check and localized by the layer-by-layer
diff to the parameters where it lives; switched off, every check passes on the same layout."""

from __future__ import annotations

import re
from pathlib import Path

import museum_cases
import pytest

from minidist.debug import museum
from minidist.parallel import Layout
from minidist.parallel.pp.pipeline import PipelineRunner

BUGS = list(museum.BUGS)


def _reference() -> dict:
    return museum_cases.reference("fp32", museum_cases.BUG_STEPS)


@pytest.mark.parametrize("name", BUGS)
def test_bug_on_its_check_fires_and_the_diff_names_its_layer(name: str) -> None:
    exhibit, record, reference = museum.BUGS[name], museum_cases.results()[name], _reference()
    fired = museum.checks(record, reference, exhibit.layout)
    assert fired[exhibit.check] is not None, f"{name}: the {exhibit.check} check did not fire: {fired}"
    report = museum.localize(name, record, reference)
    want = museum.expected_layer(name, list(reference["grads"]))
    assert want, f"{name}: its layer pattern {exhibit.layer!r} names no parameter"
    assert report.flagged == want, f"{name}: the diff flagged {report.flagged}, the bug lives in {want}"


@pytest.mark.parametrize("name", BUGS)
def test_bug_off_every_check_passes(name: str) -> None:
    record = museum_cases.results()[f"{name} off"]
    fired = museum.checks(record, _reference(), museum.BUGS[name].layout)
    assert all(v is None for v in fired.values()), f"{name} off: {fired}"


def test_the_bugs_that_hide_from_the_loss_curve_do_hide() -> None:
    """A mis-scaled gradient (clipped and Adam-normalized away), a norm weight counted twice and an embedding row
    that the corpus never reads leave the loss of the first steps within the reduction-order tolerance: only the
    checks see them."""
    from minidist.debug import tolerance

    reference = _reference()
    for name in ("pipeline_missing_1_over_m", "grad_norm_tp_replicas", "vocab_padded_inconsistently"):
        losses = museum_cases.results()[name]["losses"]
        assert tolerance.close(losses, reference["losses"]), (name, losses, reference["losses"])


def test_a_bug_is_switched_off_when_its_block_ends() -> None:
    before = PipelineRunner.step
    with museum.bug("pipeline_missing_1_over_m") as exhibit:
        assert PipelineRunner.step is not before and exhibit.name == "pipeline_missing_1_over_m"
    assert PipelineRunner.step is before
    with pytest.raises(ValueError, match="unknown bug 'nope'; the museum has no_sync_never_synced"):
        with museum.bug("nope"):
            pass


@pytest.mark.parametrize("changes, match", [
    (dict(layout=Layout.of(dp=3)), "dp=3 x microbatches=1 does not divide the global batch of 8 rows"),
    (dict(layout=Layout.of(tp=4)), "tp=4 must divide 2 kv heads"),
    (dict(layout=Layout.of(dp=2, zero=1)), "the lab varies dp, tp, pp, microbatches only, not zero"),
    (dict(dtype="fp16"), "dtype 'fp16' is not one of fp32, bf16"),
    (dict(bug="nope"), "unknown bug 'nope'"),
])
def test_a_setup_the_lab_cannot_run_is_refused_in_one_line(changes: dict, match: str) -> None:
    from minidist.debug import parity_run as pr

    with pytest.raises(ValueError, match=match) as info:
        pr.run_many([pr.Setup(**changes)])
    assert "\n" not in str(info.value)


def test_every_exhibit_names_modules_that_exist() -> None:
    """`lives_in` points a reader at the code an exhibit breaks: each module it names is in the package."""
    package = Path(museum.__file__).resolve().parents[1]
    for bug in museum.BUGS.values():
        named = re.findall(r"[a-z_/]+\.py", bug.lives_in)
        assert named and all((package / path).is_file() for path in named), (bug.name, bug.lives_in)


def test_a_catalogue_without_its_patch_is_refused(tmp_path) -> None:
    """museum.toml and the patches must name the same exhibits: an entry without code is refused, by name."""
    extra = museum.CATALOGUE.read_text() + '\n[no_such_bug]\ntitle = "x"\n'
    (tmp_path / "museum.toml").write_text(extra)
    with pytest.raises(ValueError, match="no_such_bug"):
        museum.read_catalogue(tmp_path / "museum.toml")
