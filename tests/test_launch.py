"""The launcher: results come back by rank, and every way a rank can fail is reported with that rank's number.

A failure report leads with its cause (the rank that failed first, with its own traceback), says what case was
being run, and a timeout shows where each stuck rank was.
"""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from minidist.comm.launch import LaunchTimeout, RankFailed, _describe_failures, _Failure, run_ranks


def report(scale: float) -> tuple[int, int, torch.Tensor]:
    rank = dist.get_rank()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, dist.get_world_size(), total * scale


def fail_on(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    dist.barrier()  # the healthy ranks wait on the failed one, as they would in real code
    return dist.get_rank()


def hang_on(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        time.sleep(600)
    return dist.get_rank()


def exit_on(bad_rank: int) -> int:
    if dist.get_rank() == bad_rank:
        os._exit(3)  # dies without reporting anything; the healthy rank returns normally
    return dist.get_rank()


def send_to_each_other() -> None:
    peer = 1 - dist.get_rank()
    dist.send(torch.zeros(1), peer)  # both ranks block here: each waits for a recv the other never reaches
    dist.recv(torch.zeros(1), peer)


def fail_in_turn(first: int, delay_s: float) -> None:
    """Rank `first` raises at once with a backend-like error; every other rank raises `delay_s` later."""
    if dist.get_rank() == first:
        raise RuntimeError("[gloo] Received data size doesn't match expected size")
    time.sleep(delay_s)
    raise ConnectionResetError("Connection reset by peer")


@pytest.mark.parametrize("world_size", [1, 3])
def test_results_come_back_indexed_by_rank(world_size: int) -> None:
    results = run_ranks(report, world_size, 2.0)
    expected_total = 2.0 * sum(range(world_size))
    assert [r[0] for r in results] == list(range(world_size))
    assert all(r[1] == world_size for r in results)
    assert all(float(r[2]) == expected_total for r in results)


def test_an_exception_names_its_rank() -> None:
    with pytest.raises(RankFailed, match=r"^rank 2 of 3 raised") as info:
        run_ranks(fail_on, 3, 2, timeout=60)
    assert "ValueError: deliberate failure on rank 2" in str(info.value)


def test_a_hanging_rank_times_out_and_is_named() -> None:
    timeout = 2
    run_ranks(report, 1, 1.0)  # start the launcher's forkserver first: its start-up is not part of the timeout
    start = time.monotonic()
    with pytest.raises(LaunchTimeout, match=r"timed out after 2 s; rank\(s\) \[.*\] had not finished") as info:
        run_ranks(hang_on, 3, 1, timeout=timeout)
    assert time.monotonic() - start < timeout + 5  # the timeout, plus the time to kill the ranks
    unfinished = re.search(r"rank\(s\) \[(.*)\]", str(info.value)).group(1)
    # Rank 1 hangs; on a busy machine a healthy rank may not have finished starting either, so only rank 1 is sure.
    assert "1" in [r.strip() for r in unfinished.split(",")]


def test_a_deadlock_times_out_naming_the_stuck_line_and_the_case() -> None:
    timeout = 2
    run_ranks(report, 1, 1.0)  # start the forkserver first: its start-up is not part of the timeout
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        run_ranks(send_to_each_other, 2, timeout=timeout, case="world 2, blocking sends")
    assert time.monotonic() - start < timeout + 5  # the timeout, the stack dumps, and killing the ranks
    message = str(info.value)
    assert message.startswith("send_to_each_other (case: world 2, blocking sends) on 2 ranks timed out after 2 s")
    stuck_line = send_to_each_other.__code__.co_firstlineno + 2  # the dist.send line
    for rank in (0, 1):
        assert f"rank {rank} was at" in message
    assert message.count(f"tests/test_launch.py:{stuck_line} send_to_each_other") == 2, message
    assert "deadlock? a blocking send waits for a matching recv: post isend and irecv before waiting" in message


def test_the_first_rank_to_fail_is_named_as_the_cause() -> None:
    # Rank 1 fails first, with an error that looks like a backend error; rank 0 fails 0.5 s later. The report must
    # follow the clock, not the rank number or the wording.
    with pytest.raises(RankFailed) as info:
        run_ranks(fail_in_turn, 3, 1, 0.5, timeout=30, case="world 3, uneven sizes")
    message = str(info.value)
    first_line, *rest = message.splitlines()
    assert first_line == "rank 1 of 3 raised in fail_in_turn (case: world 3, uneven sizes):"
    assert "Received data size doesn't match expected size" in message.split("then the other ranks")[0]
    consequences = message.split("then the other ranks failed too")[1]
    assert re.search(r"rank 0, \d+\.\d\d s later: ConnectionResetError: Connection reset by peer", consequences)
    assert re.search(r"rank 2, \d+\.\d\d s later: ConnectionResetError", consequences)
    # Short: the rank's own frames, not the launcher's.
    assert "minidist/comm/launch.py" not in message and len(message.splitlines()) < 15, message


def test_reports_are_ordered_by_when_they_failed_not_when_they_arrived() -> None:
    # A rank's report can arrive after a later failure's (its teardown may be slow): the clock decides the cause.
    later = _Failure(0, at=100.5, what="raised", detail="Traceback ...\nConnectionResetError: Connection reset\n")
    first = _Failure(1, at=100.0, what="raised", detail="Traceback ...\nRuntimeError: size mismatch\n")
    message = _describe_failures("f", 2, {0: later, 1: first}, running=[])
    assert message.startswith("rank 1 of 2 raised in f:\nTraceback ...\nRuntimeError: size mismatch\n")
    assert message.endswith("rank 0, 0.50 s later: ConnectionResetError: Connection reset")


def test_a_rank_that_exits_is_reported() -> None:
    with pytest.raises(RankFailed, match=r"rank 1 of 2 exited with code 3"):
        run_ranks(exit_on, 2, 1, timeout=60)


@pytest.mark.parametrize("world_size", [0, -2])
def test_bad_world_size(world_size: int) -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_ranks(report, world_size, 1.0)


def test_a_function_that_cannot_be_imported_is_refused() -> None:
    def local(x):
        return x

    with pytest.raises(ValueError, match="importable function"):
        run_ranks(local, 2, 1)
