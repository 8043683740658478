"""When things happened during a data-parallel step: gradients becoming ready, and each bucket's collective
starting and finishing. Chapter 07 draws these events to show communication overlapping backward."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from minidist.comm.communicator import Handle


@dataclass
class Timeline:
    """Events (kind, seconds since `t0`, label) recorded during a step; chapter 07 draws them.

    kinds: "grad" (a parameter's gradient is accumulated; label = name), "launch" / "done" (a bucket's collective
    started / completed, label = bucket index), "backward_end", "wait_end" (finish_grad_sync returned), and whatever
    the caller adds with `mark` (e.g. "forward_start").
    """

    t0: float = field(default_factory=time.perf_counter)
    events: list[tuple[str, float, object]] = field(default_factory=list)

    def mark(self, kind: str, label: object = None) -> None:
        # list.append is atomic under the GIL: "done" events arrive from the communication thread.
        self.events.append((kind, time.perf_counter() - self.t0, label))

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.events.clear()


def on_completion(handle: Handle, callback: Callable[[], None]) -> Callable[[], None] | None:
    """Arrange for `callback()` when the collective behind `handle` completes (for the timeline only).

    Returns None when torch will call it (a future on the communication thread), else the callback itself, to be
    called after `handle.wait()`. gloo's reduce-scatter has no future: it runs inside wait(), so the moment wait
    returns is its true completion (and waiting on it from another thread would run it twice).
    """
    work = getattr(handle, "_work", None)  # Comm's Handle wraps the torch Work of a real collective
    if work is None:
        callback()
        return None
    try:
        work.get_future().then(lambda _: callback())
        return None
    except RuntimeError:  # "Work::getFuture not implemented"
        return callback
