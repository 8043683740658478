"""The hang clinic (chapter 14): the classic distributed hangs, each reproduced on two gloo ranks with a short
timeout, and diagnosed from the flight records (`minidist.debug.diff`).

`run_hang(name, out, timeout_s)` runs one of `HANGS` on two processes (`minidist.comm.launch.run_ranks`). Each rank
talks through a `Comm` with a `FlightRecorder` over a group whose collectives give up after `timeout_s`; when its
call raises (the timeout, or gloo noticing the mismatch), or when it finishes, the rank writes its record to
`out/flight/rank{R}.json`; it also rewrites it before each call, since gloo aborts the process on some
mismatches it detects (a message longer than the receive expects). `run_hang` returns the diff's report.

- `skipped-collective`: the ranks decide from a rank-local step counter whether to all-reduce the loss for the
  log; rank 1 skips it, so its next collective, the gradient norm's, meets rank 0's loss all-reduce (the same
  shape: gloo sums a norm with a loss without a word), and rank 0's own norm all-reduce then waits forever.
- `shape-mismatch`: the ranks all-reduce buffers of different lengths (a last batch cut unevenly).
- `p2p-order`: both ranks send first and receive second. gloo's blocking send waits for the receive, as NCCL's
  does: each rank waits in a send for a receive the other will only post after its own send.
- `interleaved-few-microbatches`: interleaved 1F1B over pp=2 ranks with v=2 chunks each needs at least p
  micro-batches per group (`schedules.interleaved_groups`; the trainer refuses fewer up front). Here the data
  holds m=1 < p: rank 0, which holds the data, runs the schedule's actions for the micro-batch it has, while
  rank 1, which only sees messages, runs the whole schedule built for p micro-batches. Messages between two ranks
  carry no tags, so rank 1's receive for the missing micro-batch takes the next activation of the real one; the
  ranks drift until one waits for a message the other never sends.
- `rank0-branch`: rank 0 all-reduces its logging figures inside `if rank == 0:` (a collective in a branch only
  rank 0 takes); rank 1 goes on to the next step's collective.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.comm.communicator import Comm, Handle
from minidist.comm.launch import RankFailed, run_ranks
from minidist.comm.recorder import FlightRecorder, describe_exception, flight_path
from minidist.debug.diff import FlightError, diff, load, report
from minidist.parallel.pp.p2p import peer_of
from minidist.parallel.pp.schedules import RECV_B, RECV_F, SEND_B, SEND_F, build_schedule

WORLD = 2


def run_hang(name: str, out: Path, timeout_s: float = 3.0) -> str:
    """Run the hang `name` (one of HANGS) on two ranks; return the flight records' diff report."""
    if name not in HANGS:
        raise ValueError(f"unknown hang {name!r}; choose one of {HANGS}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    out = Path(out)
    for rank in range(WORLD):  # a previous run's records would be read as this one's
        flight_path(out, rank).unlink(missing_ok=True)
    try:
        ends = [f"rank {r}: {why}" for r, why in enumerate(
            run_ranks(run_rank, WORLD, name, str(out), timeout_s, timeout=timeout_s + 60, threads_per_rank=1,
                      case=f"hang {name}"))]
    except RankFailed as e:  # a rank gloo aborted: its record is the one written before its last call
        ends, failure = [str(e).splitlines()[0]], e
    else:
        failure = None
    try:
        dumps = load(out)
    except FlightError:
        if failure is not None:
            raise failure from None  # the ranks did not even get to write: not one of the clinic's hangs
        raise
    return "\n".join(["how the ranks ended: " + "; ".join(ends), report(dumps, diff(dumps))])


def run_rank(name: str, out: str, timeout_s: float) -> str:
    """One rank of the hang: run it, write the flight record whatever happens, return how it ended."""
    rank = dist.get_rank()
    recorder = FlightRecorder(rank, write_through=flight_path(Path(out), rank))  # gloo aborts on some mismatches
    group = dist.new_group(list(range(WORLD)), timeout=datetime.timedelta(seconds=timeout_s))
    comm = Comm(group, name="pp" if name == "interleaved-few-microbatches" else "dp", recorder=recorder)
    try:
        _SCENARIOS[name](comm, rank)
        reason = "finished"
    except Exception as exc:  # noqa: BLE001 - the timeout or gloo's error: what the clinic is here to show
        reason = describe_exception(exc)
    recorder.write(flight_path(Path(out), rank), reason)
    return reason


def _skipped_collective(comm: Comm, rank: int) -> None:
    steps_done = 3 + rank  # the bug: a rank-local counter (rank 1 resumed from a later checkpoint)
    loss, norm_sq = torch.ones(1), torch.ones(1)
    if steps_done % 3 == 0:  # log every 3 steps: only rank 0 thinks it is time
        comm.all_reduce(loss)
    comm.all_reduce(norm_sq)  # rank 1's meets rank 0's loss all-reduce (same shape: silently wrong), then hangs


def _shape_mismatch(comm: Comm, rank: int) -> None:
    rows = torch.ones(4 + rank)  # rank 1 got one more row of the last batch
    comm.all_reduce(rows)


def _p2p_order(comm: Comm, rank: int) -> None:
    other = 1 - rank
    mine, theirs = torch.ones(16), torch.empty(16)
    comm.send(mine, other)  # both ranks send first: each waits for a receive the other has not posted
    comm.recv(theirs, other)


def _interleaved_few_microbatches(comm: Comm, rank: int) -> None:
    pp, v, m = WORLD, 2, 1
    schedule = build_schedule("interleaved", pp, pp, v)[rank]  # built for p micro-batches: m < p is refused
    if rank == 0:  # the first stage holds the data, and runs the actions of the micro-batches it has
        schedule = [a for a in schedule if a.mb < m]
    sends: list[Handle] = []
    for a in schedule:
        if a.kind in (SEND_F, SEND_B):
            sends.append(comm.isend(torch.ones(2, 4), peer_of(a, pp)))
        elif a.kind in (RECV_F, RECV_B):
            comm.recv(torch.empty(2, 4), peer_of(a, pp))
    for handle in sends:
        handle.wait()


def _rank0_branch(comm: Comm, rank: int) -> None:
    loss = torch.ones(1)
    comm.all_reduce(loss)
    if rank == 0:  # the token count, gathered where it is printed: a collective only rank 0 calls
        comm.all_reduce(torch.ones(1))
    comm.all_reduce(loss)  # the next step


_SCENARIOS = {"skipped-collective": _skipped_collective, "shape-mismatch": _shape_mismatch, "p2p-order": _p2p_order,
              "interleaved-few-microbatches": _interleaved_few_microbatches, "rank0-branch": _rank0_branch}
HANGS = list(_SCENARIOS)  # the names, in the order the chapter shows them
