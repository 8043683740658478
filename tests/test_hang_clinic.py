"""The hang clinic (minidist.debug.clinic): each classic hang reproduced on two gloo ranks with a 3 s timeout ends
in time, and the diff of the flight records names the call (its line in the clinic) and the rank to blame.

The expected call sites are read from the clinic's source, and the expected message counts from the schedule, not
from any earlier output of the diff."""

import inspect
import time

import pytest

from minidist.debug import clinic
from minidist.debug.diff import diff, load
from minidist.parallel.pp.schedules import SEND_B, SEND_F, build_schedule

TIMEOUT_S = 3.0
SLACK_S = 15.0  # starting two ranks, gloo's teardown, the launcher's wait for a rank that aborted


def _site(function, text: str) -> str:
    """'debug/clinic.py:LINE in FUNCTION' for the line of `function` that contains `text`."""
    lines, first = inspect.getsourcelines(function)
    matches = [first + i for i, line in enumerate(lines) if text in line]
    assert len(matches) == 1, f"{text!r} appears {len(matches)} times in {function.__name__}"
    return f"debug/clinic.py:{matches[0]} in {function.__name__}"


def _run(name, tmp_path):
    started = time.monotonic()
    text = clinic.run_hang(name, tmp_path, TIMEOUT_S)
    took = time.monotonic() - started
    print(f"{name}: {took:.1f} s\n{text}")
    assert took < TIMEOUT_S + SLACK_S
    findings = diff(load(tmp_path))
    assert findings, text
    assert text.splitlines()[-len(findings)].startswith(f"first divergence ({findings[0].kind}): ")
    return findings


def test_a_rank_that_skips_a_collective(tmp_path):
    first = _run("skipped-collective", tmp_path)[0]
    assert (first.kind, first.rank, first.group, first.index) == ("skipped", 1, "dp", 0)
    assert f"skipped all_reduce (1,) float32 sum at {_site(clinic._skipped_collective, 'all_reduce(loss)')}" in (
        first.message)


def test_shapes_that_differ_across_ranks(tmp_path):
    first = _run("shape-mismatch", tmp_path)[0]
    assert (first.kind, first.index) == ("mismatch", 0)
    assert "disagree on shape:" in first.message
    site = _site(clinic._shape_mismatch, "comm.all_reduce(rows)")
    assert f"rank 0: all_reduce (4,) float32 sum at {site}" in first.message
    assert f"rank 1: all_reduce (5,) float32 sum at {site}" in first.message


def test_p2p_posted_in_an_order_nccl_cannot_match(tmp_path):
    findings = _run("p2p-order", tmp_path)
    site = _site(clinic._p2p_order, "comm.send(")
    assert [(f.kind, f.rank) for f in findings] == [("p2p-order", 0), ("p2p-order", 1)]
    for f in findings:
        assert f"send (16,) float32 to rank {1 - f.rank} at {site}" in f.message


def test_fewer_microbatches_than_stages_in_an_interleaved_schedule(tmp_path):
    first = _run("interleaved-few-microbatches", tmp_path)[0]
    # Rank 0 sends rank 1 the messages of the one micro-batch it has: rank 1's next receive has no send.
    rank0 = build_schedule("interleaved", 2, 2, 2)[0]
    sent = sum(1 for a in rank0 if a.mb < 1 and a.kind in (SEND_F, SEND_B))
    assert (first.kind, first.rank, first.group, first.index) == ("p2p-unmatched", 1, "pp", sent)
    site = _site(clinic._interleaved_few_microbatches, "comm.recv(")
    assert f"recv (2, 4) float32 from rank 0 at {site}" in first.message
    assert f"rank 0 sent only {sent} message(s) to rank 1" in first.message


def test_a_collective_inside_a_branch_only_rank0_takes(tmp_path):
    first = _run("rank0-branch", tmp_path)[0]
    assert (first.kind, first.rank, first.index) == ("skipped", 1, 1)
    assert f"at {_site(clinic._rank0_branch, 'all_reduce(torch.ones(1))')} that rank 0 made" in first.message


def test_run_hang_refuses_unknown_names(tmp_path):
    assert set(clinic.HANGS) == set(clinic._SCENARIOS)
    with pytest.raises(ValueError, match="unknown hang 'nope'; choose one of"):
        clinic.run_hang("nope", tmp_path)
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        clinic.run_hang("p2p-order", tmp_path, 0)
