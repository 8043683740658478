"""The flight recorder: every rank keeps its recent collectives and point-to-point calls, and writes them out when
the run fails, times out or is signalled, so that `python -m minidist.debug diff OUT` can line the ranks up.

A `FlightRecorder` is one rank's ring buffer. Every `Comm` built with it (`Comm(..., recorder=r)`, or a `Topology`
built with `recorder=r`) appends one record per call before it communicates: the group (name and global ranks),
the op, the tensor's shape and dtype, the peer for point-to-point calls, and the call site, the first frame
outside `minidist/comm/communicator.py` (e.g. "parallel/zero.py:123 in step"). Each record also carries its *index*: the
number of calls of its kind this rank made before it on that group (collectives: per group; sends: per group and
destination; receives: per group and source). The k-th collective of a group must meet the k-th collective of
every other member, and, NCCL having no tags, the i-th send from a to b meets the i-th receive b posts from a.
So records line up across ranks by their index even when the ring has dropped older calls.

Cost in the hot loop: a dict look-up for the index, a walk of a few frames with `sys._getframe` (the site is
kept as a code object and a line number, formatted only when written), and a deque append of a tuple. Measured
on a shared 2-core CPU box (Python 3.11, torch 2.13, best of 5 × 100,000 calls): 1.9 µs per recorded call, against
0.09 µs for an empty call (`tests/test_flight_recorder.py::test_recording_is_cheap` measures it again).

A process that dies without running Python again (gloo aborts on a size mismatch it detects, a segfault, an
OOM kill) cannot write on the way out; `write_through=path` rewrites the record before every call instead (slow:
for such debugging, and for the hang clinic, whose ranks make a handful of calls).

`write(path, reason)` writes JSON (never pickle): `{"format", "rank", "reason", "started_at", "written_at",
"capacity", "dropped", "waiting_on", "records": [...]}` (`waiting_on`: the seq of the call the rank is blocked
in, null when in none; a wait that raised leaves it set). `recording(recorder, out, rank)` is the trainer's hook: it
writes `out/flight/rank{R}.json` when the block raises (a collective past --comm-timeout raises in the rank), and on
SIGTERM (torchrun stopping the job; the rank then ends as the signal would have ended it) or SIGUSR1 (a dump on
demand; the rank goes on). The signals are caught through a wakeup file descriptor read by a thread, so a rank
blocked inside a C++ collective still writes its record.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from minidist.out_files import replace_file

FORMAT = "minidist-flight/1"
CAPACITY = 2048  # records kept per rank: a few steps of a small model, the last micro-batches of a big one
P2P_OPS = ("send", "recv")
# Comm's own frames, named as Python names them (the same import path as this file's).
_COMM_FILE = os.path.join(os.path.dirname(__file__), "communicator.py")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../minidist
_ROOT = os.path.dirname(_PACKAGE)
_MAX_DEPTH = 8  # frames walked to leave communicator.py; deeper than any Comm method calls itself
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # torchrun stopping the job; a dump on demand


def flight_path(out: Path, rank: int) -> Path:
    """Where rank `rank` writes its record in the run directory `out`."""
    return Path(out) / "flight" / f"rank{rank}.json"


class FlightRecorder:
    """One rank's recent communication calls, oldest first, at most `capacity` of them."""

    def __init__(self, rank: int, capacity: int = CAPACITY, write_through: Path | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.rank = rank
        self.capacity = capacity
        self.write_through = write_through  # rewrite this file at every call (slow: for ranks that get killed)
        self.seq = 0  # calls recorded since the start, dropped ones included
        self.started_at: float | None = None  # when the job's groups were up (`start`): tells jobs apart
        self._ring: deque[tuple] = deque(maxlen=capacity)
        self._counts: dict[tuple, int] = {}
        self.waiting_on: int | None = None  # the seq of the call this rank is blocked in now (None: in none)

    def record(self, group: str, ranks: tuple[int, ...], op: str, shape: tuple[int, ...], dtype: Any,
               peer: int | None = None, batch: int | None = None, detail: str | None = None) -> int:
        """Append one call; `peer` is the other end's global rank (p2p only), `batch` the seq of the first message
        posted together with this one. Returns this record's seq."""
        key = (group, ranks, op, peer) if op in P2P_OPS else (group, ranks)
        index = self._counts.get(key, 0)
        self._counts[key] = index + 1
        frame = sys._getframe(1)
        depth = 0
        while frame.f_back is not None and frame.f_code.co_filename == _COMM_FILE and depth < _MAX_DEPTH:
            frame, depth = frame.f_back, depth + 1
        seq = self.seq
        self._ring.append((seq, group, ranks, op, index, shape, dtype, peer, batch, detail, frame.f_code,
                           frame.f_lineno))
        self.seq = seq + 1
        if self.write_through is not None:
            self.write(self.write_through, f"still running at call {seq} (written before each call)")
        return seq

    def start(self) -> None:
        """Mark the job's start (every rank calls it right after the process groups exist, so within a moment of
        each other): the diff then tells a stale record of an earlier job from this job's."""
        self.started_at = time.time()

    def __len__(self) -> int:
        return len(self._ring)

    def records(self) -> list[dict[str, Any]]:
        """The kept records as plain dicts (what `write` puts in the file), oldest first."""
        out = []
        for seq, group, ranks, op, index, shape, dtype, peer, batch, detail, code, line in self._ring:
            out.append({"seq": seq, "group": group, "ranks": list(ranks), "op": op, "index": index,
                        "shape": list(shape), "dtype": str(dtype).removeprefix("torch."), "peer": peer,
                        "batch": batch, "detail": detail, "site": _site(code.co_filename, line, code.co_name)})
        return out

    def snapshot(self, reason: str) -> dict[str, Any]:
        return {"format": FORMAT, "rank": self.rank, "reason": reason, "started_at": self.started_at,
                "written_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
                "capacity": self.capacity, "dropped": self.seq - len(self._ring), "waiting_on": self.waiting_on,
                "records": self.records()}

    def write(self, path: Path, reason: str) -> Path:
        """Write the record to `path` as JSON, never through a symbolic link (`minidist.out_files`: a temporary
        file renamed over it, so a reader never sees half of it)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        return replace_file(path, (json.dumps(self.snapshot(reason), indent=1) + "\n").encode())


def _site(filename: str, line: int, function: str) -> str:
    """'parallel/zero.py:123 in step': relative to the package for its own files, else to the repository."""
    path = os.path.abspath(filename)
    for base in (_PACKAGE, _ROOT):
        if path.startswith(base + os.sep):
            path = path[len(base) + 1:]
            break
    else:
        path = os.path.basename(path)
    return f"{path}:{line} in {function}"


def describe_exception(exc: BaseException) -> str:
    """One line for the record's `reason`: the exception's type and its first line, cut to 200 characters."""
    first = (str(exc).strip().splitlines() or [""])[0]
    first = re.sub(r"^\[[^\]]*\] ", "", first)  # gloo's "[/path/to/pair.cc:537] " source location
    first = first.split(". This is typically")[0]  # and gloo's advice after it
    return f"{type(exc).__name__}: {first}"[:200]


# ---------------------------------------------------------------------------------------------------------------
# The trainer's hook: write on an exception, SIGTERM or SIGUSR1
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def recording(recorder: FlightRecorder | None, out: Path, rank: int, ignore: tuple[type[BaseException], ...] = (),
              signals: tuple[signal.Signals, ...] = SIGNALS) -> Iterator[None]:
    """Within the block, write `recorder` to `out/flight/rank{rank}.json` if the block raises (except the `ignore`
    types: bad settings are no communication failure) or on one of `signals`. Nothing happens for None.

    Signals are taken only in the main thread, and only those without a Python handler. Pass `signals=()` in a
    process whose signals belong to someone else: `signal.getsignal` does not see handlers installed from C (under
    `minidist.comm.launch.run_ranks`, SIGUSR1 is faulthandler's stack dump), and leaving the block restores SIG_DFL.
    """
    if recorder is None:
        yield
        return
    path = flight_path(out, rank)
    main = threading.current_thread() is threading.main_thread()
    watcher = _SignalWatcher(recorder, path, signals) if main and signals else None
    try:
        yield
    except ignore:
        raise
    except BaseException as exc:
        try:
            _announce(recorder.write(path, describe_exception(exc)), out, rank)
        except (OSError, ValueError) as e:  # the failure being reported matters more than its record
            print(f"rank {rank}: no flight record: {e}", file=sys.stderr, flush=True)
        raise
    finally:
        if watcher is not None:
            watcher.close()


class _SignalWatcher:
    """Python runs signal handlers in the main thread between bytecodes, which never comes while the main thread is
    blocked in a collective. Its C handler does write the signal's number to the wakeup fd at once, so a thread
    reading that fd writes the record (gloo and NCCL waits release the GIL)."""

    def __init__(self, recorder: FlightRecorder, path: Path, signals: tuple[signal.Signals, ...]) -> None:
        self.recorder, self.path = recorder, path
        self.taken = [s for s in signals if signal.getsignal(s) == signal.SIG_DFL]
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.write_fd, False)
        self.previous_fd = signal.set_wakeup_fd(self.write_fd, warn_on_full_buffer=False)
        for s in self.taken:
            signal.signal(s, _note)  # the Python-level handler has nothing to do: the thread does the work
        self.thread = threading.Thread(target=self._watch, name="flight-recorder", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        while True:
            data = os.read(self.read_fd, 64)
            if not data or 0 in data:  # closed, or the sentinel from close()
                return
            for signum in data:
                if signum not in self.taken:
                    continue
                name = signal.Signals(signum).name
                _announce(self.recorder.write(self.path, f"signal {name}"), self.path.parent.parent,
                          self.recorder.rank)
                if signum == signal.SIGTERM:
                    # End as SIGTERM's default action would (torchrun is stopping the job); 128 + n is the shell's
                    # code for "killed by signal n". A thread cannot restore the default handler itself.
                    os._exit(128 + signum)

    def close(self) -> None:
        for s in self.taken:
            signal.signal(s, signal.SIG_DFL)
        signal.set_wakeup_fd(self.previous_fd)
        os.write(self.write_fd, b"\0")
        self.thread.join(timeout=5)
        os.close(self.read_fd)
        os.close(self.write_fd)


def _announce(path: Path, out: Path, rank: int) -> None:
    print(f"rank {rank}: flight record in {path}; line the ranks up with: python -m minidist.debug diff {out}",
          file=sys.stderr, flush=True)


def _note(signum: int, frame: Any) -> None:
    """The Python-level handler of a taken signal: the watcher thread already acts on it."""
