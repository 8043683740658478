"""The launcher: results come back by rank, and every way a rank can fail is reported with that rank's number."""

import os
import re
import time

import pytest
import torch
import torch.distributed as dist

from minidist.launch import LaunchTimeout, RankFailed, run_ranks


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
