"""Run a function on N local ranks (tests, notebooks, benchmarks).

Every rank is a separate process joined into one gloo process group. The launcher:
- starts processes through a `forkserver` that has already imported torch, so a launch costs a fraction of a
  second instead of the ~6 s each fresh `import torch` takes;
- rendezvous through a TCPStore that the caller opens on a port the OS picks, so parallel tests never collide;
- returns whatever each rank's function returned, as a list indexed by rank;
- enforces a timeout on the whole run, and makes failures easy to trace to their cause.

Failure reports. When one rank raises, its peers usually fail a moment later inside a collective, only because it
left ("Connection reset by peer"). So every failure is stamped with the time it happened, and `RankFailed` leads
with the rank that failed first, with its own traceback, and lists the later ones as consequences. When the run
times out, each rank still running dumps its Python stack (faulthandler, on a signal from the launcher), and
`LaunchTimeout` shows where each one was stuck. An optional `case` (e.g. "world 3, group [0, 2], shape (7,)")
says what was being run, in both messages.

The function must be importable (defined in a module, not in `__main__` or a notebook cell): a forkserver child
finds it by its qualified name.
"""

from __future__ import annotations

import datetime
import faulthandler
import io
import multiprocessing as mp
import os
import queue
import re
import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# torch._dynamo is imported by the first optimizer.step(); preloading it saves ~6 s of CPU per rank per launch.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "minidist"]
_context: mp.context.BaseContext | None = None

_DUMP_SIGNAL = signal.SIGUSR1  # the launcher sends it to ranks still running at the timeout
_SETTLE_S = 2.0  # after a first failure, how long to wait for the others, so that the earliest can be named
_FRAMES_SHOWN = 6  # innermost frames per stuck rank: torch's wrappers, then the learner's own lines
_CONSEQUENCE_CHARS = 160  # each later failure is one line, cut to this length
_DEADLOCK_HINT = "deadlock? a blocking send waits for a matching recv: post isend and irecv before waiting"


class RankFailed(RuntimeError):
    """A rank raised or died; the message names the rank that failed first, with its traceback."""


class LaunchTimeout(TimeoutError):
    """The run did not finish within its timeout; the message names the ranks still running and where they were."""


@dataclass
class _Failure:
    rank: int
    at: float  # time.time() when it happened: ranks are processes on one machine, so their clocks agree
    what: str  # "raised" or how it died
    detail: str = ""  # the rank's traceback, if it raised


def _get_context() -> mp.context.BaseContext:
    global _context
    if _context is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _context = ctx
    return _context


def _to_bytes(obj: Any) -> bytes:
    # torch.save pickles tensors by value, so results survive the worker's exit (no shared-memory handles).
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_bytes(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


# ---------------------------------------------------------------------------------------------------------------
# In each rank
# ---------------------------------------------------------------------------------------------------------------


def _worker(
    rank: int,
    world_size: int,
    store_port: int,
    timeout_s: float,
    threads: int,
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    results: Any,
    stack_file: str,
) -> None:
    failed_at = None
    try:
        _arm_stack_dump(stack_file)
        torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            value = fn(*args, **kwargs)
        except BaseException:
            failed_at = time.time()  # now, not after the teardown below, which can take a while
            raise
        finally:
            dist.destroy_process_group()
        results.put((rank, True, _to_bytes(value), 0.0))
    except BaseException as exc:  # noqa: BLE001 - everything a rank raises must reach the caller
        results.put((rank, False, _format_exception(exc), failed_at if failed_at is not None else time.time()))


def _arm_stack_dump(path: str) -> None:
    """On `_DUMP_SIGNAL`, write every Python thread's stack to `path`, after a first line naming the main thread.

    faulthandler writes from the signal handler itself, so the dump comes even while the rank is blocked inside
    a C++ call, such as a gloo receive whose message will never come.
    """
    file = open(path, "w")  # faulthandler keeps a reference: it stays open for the life of the process
    file.write(f"main thread {threading.get_ident():#018x}\n")
    file.flush()
    faulthandler.register(_DUMP_SIGNAL, file=file, all_threads=True)


def _format_exception(exc: BaseException) -> str:
    """The rank's traceback, starting at its own function: the launcher's frames are the same in every failure."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


# ---------------------------------------------------------------------------------------------------------------
# In the caller
# ---------------------------------------------------------------------------------------------------------------


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads_per_rank: int | None = None,
    case: str | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks of one gloo group; return the results by rank.

    Inside `fn`, `torch.distributed` is initialised: `dist.get_rank()` and `dist.get_world_size()` work, and the
    default group spans all ranks. Raises `RankFailed` naming the rank that failed first (with its traceback) and
    `LaunchTimeout` naming the ranks still running when `timeout` seconds have passed, with where each was stuck.
    `case` describes what this launch runs (e.g. "world 3, group [0, 2], shape (7,)") for those messages.
    """
    __tracebackhide__ = True  # pytest: show the caller's line and the message, not this function's source
    _check_launchable(fn, world_size)
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
    where = fn.__qualname__ + (f" (case: {case})" if case else "")

    ctx = _get_context()
    # The caller owns the rendezvous store; port 0 lets the OS pick a free port, so concurrent runs never clash.
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    results = ctx.Queue()
    stack_dir = tempfile.mkdtemp(prefix="minidist-stacks-")
    stack_files = [os.path.join(stack_dir, f"rank{rank}.txt") for rank in range(world_size)]
    processes = [_start_rank(ctx, rank, (rank, world_size, store.port, timeout, threads_per_rank, fn, args, kwargs,
                                         results, stack_files[rank]))
                 for rank in range(world_size)]
    try:
        outputs = _collect(results, processes, where, timeout, stack_files)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=5)
        results.close()
        del store
        shutil.rmtree(stack_dir, ignore_errors=True)
    return [outputs[rank] for rank in range(world_size)]


def _check_launchable(fn: Callable[..., Any], world_size: int) -> None:
    """ValueError unless `world_size` is positive and a forkserver child can import `fn` by its qualified name."""
    __tracebackhide__ = True
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if getattr(fn, "__module__", None) == "__main__" or "<locals>" in getattr(fn, "__qualname__", ""):
        raise ValueError(
            f"run_ranks needs an importable function, but {fn.__qualname__} is defined in __main__ or inside "
            "another function; move it to a module (in a notebook: %%writefile a .py file and import it)"
        )


def _start_rank(ctx: mp.context.BaseContext, rank: int, worker_args: tuple) -> Any:
    """Start the process of one rank, running `_worker(*worker_args)`."""
    process = ctx.Process(target=_worker, args=worker_args, name=f"minidist-rank{rank}", daemon=True)
    process.start()
    return process


def _collect(results: Any, processes: list, where: str, timeout: float, stack_files: list[str]) -> dict[int, Any]:
    """Every rank's result by rank. Raises LaunchTimeout at the deadline, and RankFailed once the ranks that fail
    after a first failure have had `_SETTLE_S` to report (so that the earliest can be named)."""
    __tracebackhide__ = True
    world_size = len(processes)
    outputs: dict[int, Any] = {}
    failures: dict[int, _Failure] = {}
    deadline = time.monotonic() + timeout
    settle_by = None
    while len(outputs) + len(failures) < world_size:
        now = time.monotonic()
        if failures and now >= min(settle_by, deadline):
            break
        if now >= deadline:
            running = [r for r in range(world_size) if r not in outputs]
            raise LaunchTimeout(_describe_timeout(where, world_size, timeout, running, processes, stack_files))
        try:
            _record(results.get(timeout=min(0.2, deadline - now)), outputs, failures)
        except queue.Empty:
            _record_a_silent_exit(processes, results, outputs, failures)
        if failures and settle_by is None:
            settle_by = time.monotonic() + _SETTLE_S
    if failures:
        running = [r for r in range(world_size) if r not in outputs and r not in failures]
        raise RankFailed(_describe_failures(where, world_size, failures, running))
    return outputs


def _record(message: tuple, outputs: dict[int, Any], failures: dict[int, _Failure]) -> None:
    rank, ok, payload, at = message
    if ok:
        outputs[rank] = _from_bytes(payload)
    else:
        failures[rank] = _Failure(rank, at, "raised", payload)


def _record_a_silent_exit(processes: list, results: Any, outputs: dict[int, Any],
                          failures: dict[int, _Failure]) -> None:
    """A rank that exits without reporting (segfault, os._exit, OOM kill) is a failure too."""
    for rank, process in enumerate(processes):
        if rank in outputs or rank in failures or process.exitcode is None:
            continue
        # A rank flushes its report before exiting, but it may have landed just after our poll: one more look.
        try:
            _record(results.get(timeout=0.5), outputs, failures)
        except queue.Empty:
            failures[rank] = _Failure(rank, time.time(), f"exited with code {process.exitcode} without reporting")
        return


def _describe_failures(where: str, world_size: int, failures: dict[int, _Failure], running: list[int]) -> str:
    first, *later = sorted(failures.values(), key=lambda f: f.at)
    message = f"rank {first.rank} of {world_size} {first.what} in {where}"
    message += f":\n{first.detail}" if first.detail else "\n"
    if later:
        message += f"then the other ranks failed too, most likely because rank {first.rank} had stopped:\n"
        for f in later:
            last_line = f.detail.strip().splitlines()[-1] if f.detail else f.what
            if len(last_line) > _CONSEQUENCE_CHARS:  # gloo's errors run on for a paragraph
                last_line = last_line[:_CONSEQUENCE_CHARS] + " ..."
            message += f"  rank {f.rank}, {f.at - first.at:.2f} s later: {last_line}\n"
    if running:
        message += f"rank(s) {running} were still running\n"
    return message.rstrip("\n")


def _describe_timeout(where: str, world_size: int, timeout: float, running: list[int], processes: list,
                      stack_files: list[str]) -> str:
    for rank in running:
        if processes[rank].is_alive():
            try:
                os.kill(processes[rank].pid, _DUMP_SIGNAL)
            except ProcessLookupError:
                pass  # it exited just now
    dumps = _read_stack_dumps([stack_files[rank] for rank in running])
    lines = [f"{where} on {world_size} ranks timed out after {timeout:.0f} s; rank(s) {running} had not finished"]
    for rank, dump in zip(running, dumps):
        frames = _innermost_frames(dump)
        if frames:
            lines.append(f"  rank {rank} was at (innermost frame first):")
            lines += [f"    {frame}" for frame in frames]
        else:
            lines.append(f"  rank {rank}: no stack dump (it had not started, or had just exited)")
    lines.append(_DEADLOCK_HINT)
    return "\n".join(lines)


def _read_stack_dumps(paths: list[str], wait_s: float = 1.0) -> list[str]:
    """The dumps the signalled ranks write; those that have not written within `wait_s` are read as they are."""
    def read(path: str) -> str:
        try:
            with open(path) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    give_up = time.monotonic() + wait_s
    while time.monotonic() < give_up and not all("most recent call first" in read(p) for p in paths):
        time.sleep(0.02)
    time.sleep(0.02)  # a dump is written in a few calls; let the last one land
    return [read(p) for p in paths]


_FRAME = re.compile(r'File "(?P<file>.+)", line (?P<line>\d+) in (?P<function>.+)')


def _innermost_frames(dump: str) -> list[str]:
    """'file:line function' for the innermost frames of the main thread in a faulthandler dump, above the launcher."""
    header, _, body = dump.partition("\n")
    main = header.removeprefix("main thread ").strip()
    blocks = [b for b in body.split("\n\n") if "most recent call first" in b]
    if not main or not blocks:
        return []
    block = next((b for b in blocks if main in b.splitlines()[0]), blocks[-1])
    frames = []
    for m in _FRAME.finditer(block):
        if m["function"] == "_worker" and os.path.basename(m["file"]) == "launch.py":
            break  # the launcher's frame and multiprocessing's below it are the same in every dump
        frames.append(f"{_short_path(m['file'])}:{m['line']} {m['function']}")
    return frames[:_FRAMES_SHOWN]


def _short_path(path: str) -> str:
    """Relative to the working directory, or to site-packages, when it is below one."""
    if "site-packages" + os.sep in path:
        return path.split("site-packages" + os.sep, 1)[1]
    cwd = os.getcwd() + os.sep
    return path[len(cwd):] if path.startswith(cwd) else path
