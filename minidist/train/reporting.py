"""How a rank's error reaches the user, whichever rank meets it and whoever launched it.

Every rank that stops prints its own one line on stderr (srun and a plain launch show every process's stderr). Under
torchrun that line would be followed by the elastic agent's summary of the first failed worker, which it reads
from the JSON file named by TORCHELASTIC_ERROR_FILE (`error_file: <N/A>` when the worker wrote none): the line is
written there too, in the layout of torch's own `ErrorHandler.record_exception`
(torch/distributed/elastic/multiprocessing/errors/error_handler.py: {"message": {"message", "extraInfo":
{"py_callstack", "timestamp"}}}), so the summary's `traceback :` field is the line itself. torch's `@record` does not
help: it writes nothing for a non-zero SystemExit and a whole traceback for an exception.

Joining the process group (`rendezvous`) is where a rank alone learns that no peer came: c10d's C++ logger then
prints each failed try with ~40 lines of C++ frames on the process's stderr (file descriptor 2, below Python).
That output is held in a temporary file while the rank joins: on success its lines come out without the frames,
on a failure the rank's one line replaces them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping

from minidist.comm.bootstrap import DistEnv

ERROR_FILE = "TORCHELASTIC_ERROR_FILE"
_FRAME = re.compile(r"frame #\d+:|Exception raised from |<omitting python frames>|\s*$")


class JoinFailed(RuntimeError):
    """This rank could not join the process group (no peer came within the timeout, or the address is wrong)."""


def error_record(line: str, now: float | None = None) -> dict:
    """The error file's JSON for `line`, as torch's ErrorHandler lays it out."""
    stamp = str(int(time.time() if now is None else now))
    return {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": stamp}}}


def report(line: str, environ: Mapping[str, str] | None = None, consequence: bool = False) -> None:
    """Print `error: line` on stderr and, under torchrun, write it to the worker's error file. A `consequence`
    (a collective or the rendezvous failed because a peer stopped) is stamped one second later: the agent names the
    failure with the smallest whole-second stamp as the root cause, and the peer's own error came first."""
    print(f"error: {line}", file=sys.stderr, flush=True)
    path = (os.environ if environ is None else environ).get(ERROR_FILE)
    if path:
        try:  # torchrun's own file in its own directory, written as its handler writes it
            with open(path, "w") as f:
                json.dump(error_record(line, time.time() + (1 if consequence else 0)), f)
        except OSError:
            pass  # the line is on stderr already; the summary then says <N/A>


def without_frames(text: str) -> str:
    """`text` (c10d's log) without the C++ stack frames and blank lines."""
    return "".join(line for line in text.splitlines(keepends=True) if not _FRAME.match(line))


@contextlib.contextmanager
def rendezvous(where: str, timeout_s: float) -> Iterator[None]:
    """Join the process group inside this block: fd 2 held meanwhile (module docstring); any failure becomes one
    `JoinFailed` line naming `where` (MASTER_ADDR:MASTER_PORT) and the timeout."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        failed = None
        try:
            yield
        except RuntimeError as e:  # torch's DistError family: a store or a peer that did not answer
            failed = e
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            log = held.read().decode("utf-8", errors="replace")
        if failed is None:
            sys.stderr.write(without_frames(log))
            return
    first = (str(failed).strip().splitlines() or [type(failed).__name__])[0]
    raise JoinFailed(f"could not join the job's processes at {where} within --comm-timeout {timeout_s:g} s: "
                     f"{first} (a rank that never joined printed its own error; is every rank started, with the "
                     "same MASTER_ADDR/MASTER_PORT?)") from None


def ranked(message: str) -> str:
    """`message` prefixed with this rank when the job has several."""
    rank, world = place()
    return f"rank {rank}: {message}" if world > 1 else message


def place() -> tuple[int, int]:
    """This process's (rank, world size) for an error message; (0, 1) when the launcher's variables are the error."""
    try:
        env = DistEnv.detect()
    except ValueError:
        return 0, 1
    return env.rank, env.world_size


def rendezvous_address() -> str:
    """MASTER_ADDR:MASTER_PORT as the launcher set them, for the message of a rank that could not join."""
    return f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
