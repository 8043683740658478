"""Run a function on N local ranks (tests, notebooks, benchmarks).

Every rank is a separate process joined into one gloo process group. The launcher:
- starts processes through a `forkserver` that has already imported torch, so a launch costs a fraction of a
  second instead of the ~6 s each fresh `import torch` takes;
- rendezvous through a TCPStore that the caller opens on a port the OS picks, so parallel tests never collide;
- enforces a timeout on the whole run, and reports which rank failed, with its traceback;
- returns whatever each rank's function returned, as a list indexed by rank.

The function must be importable (defined in a module, not in `__main__` or a notebook cell): a forkserver child
finds it by its qualified name.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

# torch._dynamo is imported by the first optimizer.step(); preloading it saves ~6 s of CPU per rank per launch.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "minidist"]
_context: mp.context.BaseContext | None = None


class RankFailed(RuntimeError):
    """A rank raised an exception or died; the message names the rank and carries its traceback."""


class LaunchTimeout(TimeoutError):
    """The run did not finish within its timeout; the message names the ranks still running."""


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
) -> None:
    try:
        torch.set_num_threads(threads)
        store = dist.TCPStore("127.0.0.1", store_port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        try:
            value = fn(*args, **kwargs)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, _to_bytes(value)))
    except BaseException:  # noqa: BLE001 - everything a rank raises must reach the caller
        results.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads_per_rank: int | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `world_size` ranks of one gloo group; return the results by rank.

    Inside `fn`, `torch.distributed` is initialised: `dist.get_rank()` and `dist.get_world_size()` work, and the
    default group spans all ranks. Raises `RankFailed` naming the first rank that raised (with its traceback) and
    `LaunchTimeout` naming the ranks still running when `timeout` seconds have passed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if getattr(fn, "__module__", None) == "__main__" or "<locals>" in getattr(fn, "__qualname__", ""):
        raise ValueError(
            f"run_ranks needs an importable function, but {fn.__qualname__} is defined in __main__ or inside "
            "another function; move it to a module (in a notebook: %%writefile a .py file and import it)"
        )
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)

    ctx = _get_context()
    # The caller owns the rendezvous store; port 0 lets the OS pick a free port, so concurrent runs never clash.
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    results = ctx.Queue()
    processes = []
    for rank in range(world_size):
        process = ctx.Process(
            target=_worker,
            args=(rank, world_size, store.port, timeout, threads_per_rank, fn, args, kwargs, results),
            name=f"minidist-rank{rank}",
            daemon=True,
        )
        process.start()
        processes.append(process)

    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                running = sorted(set(range(world_size)) - set(outputs))
                raise LaunchTimeout(
                    f"run_ranks({fn.__qualname__}, world_size={world_size}) timed out after {timeout:.0f} s; "
                    f"rank(s) {running} had not finished"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                _check_for_dead_ranks(processes, outputs, results)
                continue
            if not ok:
                failures = {rank: payload}
                _collect_more_failures(results, failures, outputs, world_size)
                raise RankFailed(_describe_failures(fn.__qualname__, world_size, failures))
            outputs[rank] = _from_bytes(payload)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(timeout=5)
        results.close()
        del store
    return [outputs[rank] for rank in range(world_size)]


def _check_for_dead_ranks(processes: list, outputs: dict, results: Any) -> None:
    """A rank that exits without reporting (segfault, os._exit, OOM kill) fails the run at once."""
    for rank, process in enumerate(processes):
        if rank not in outputs and process.exitcode is not None:
            # Its report may have landed between our poll and now; give the queue one last chance.
            try:
                reported_rank, ok, payload = results.get(timeout=0.5)
            except queue.Empty:
                raise RankFailed(
                    f"rank {rank} of {len(processes)} exited with code {process.exitcode} without reporting"
                ) from None
            if not ok:
                raise RankFailed(f"rank {reported_rank} of {len(processes)} raised:\n{payload}")
            outputs[reported_rank] = _from_bytes(payload)


# When one rank raises, its peers soon fail too, inside a collective whose connection just closed. Those
# secondary errors say nothing about the cause, so the report leads with a rank whose error is not one of them.
_SECONDARY_ERROR_MARKERS = ("DistBackendError", "Connection closed", "Connection reset", "gloo")


def _collect_more_failures(results: Any, failures: dict, outputs: dict, world_size: int,
                           grace_s: float = 2.0) -> None:
    deadline = time.monotonic() + grace_s
    while len(failures) + len(outputs) < world_size and time.monotonic() < deadline:
        try:
            rank, ok, payload = results.get(timeout=max(0.01, deadline - time.monotonic()))
        except queue.Empty:
            return
        if not ok:
            failures[rank] = payload


def _describe_failures(name: str, world_size: int, failures: dict[int, str]) -> str:
    def is_secondary(tb: str) -> bool:
        last_line = tb.strip().splitlines()[-1]
        return any(marker in last_line for marker in _SECONDARY_ERROR_MARKERS)

    ordered = sorted(failures, key=lambda r: (is_secondary(failures[r]), r))
    primary = ordered[0]
    message = f"rank {primary} of {world_size} raised in {name}:\n{failures[primary]}"
    others = [f"rank {r}: {failures[r].strip().splitlines()[-1]}" for r in ordered[1:]]
    if others:
        message += "then the other ranks failed too:\n  " + "\n  ".join(others)
    return message
