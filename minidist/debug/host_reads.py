"""What a GPU step pays for that a CPU run hides, counted on the CPU: the reads of tensor values on the host by the
package's own code, and the aten operators a step runs.

A read of a tensor's value on the host (`.item()`, `.tolist()`, `float(t)`, `int(t)`, `if t:`, `.cpu()`,
`.numpy()`, a tensor used as an index, `torch.equal`) waits on a GPU for every kernel queued before it: the host
stops feeding the device. On a CPU it costs nothing, so nothing shows it. `HostReads` replaces these methods of
`torch.Tensor` for the duration of a `with` block and counts the calls whose caller is a file of `minidist/` (torch's
own reads, and the caller's, are not the package's). `OpCount` counts the aten operators dispatched (views apart:
a view launches no kernel), what a GPU launches one kernel each for when nothing fuses them.

Both sort their counts by step: `next_step()` starts a new step (the benchmark `bench/syncs.py` calls it where the
trainer starts each step), and `per_step` holds one count per step (index -1: before the first).
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import minidist

PACKAGE = os.path.dirname(os.path.abspath(minidist.__file__)) + os.sep
READ_METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__format__", "cpu", "numpy")


class _Steps:
    """Counts sorted by step: `next_step()` moves on; `per_step[-1]` holds what came before the first step."""

    def __init__(self) -> None:
        self.step = -1
        self.per_step: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)

    def next_step(self) -> None:
        self.step += 1

    def add(self, key: str) -> None:
        self.per_step[self.step][key] += 1

    def total(self, step: int) -> int:
        return sum(self.per_step.get(step, {}).values())


class HostReads(_Steps):
    """Counts, by step and by site ("path:line method"), the host reads of tensor values made by `minidist/`."""

    def __enter__(self) -> HostReads:
        self._saved = {name: getattr(torch.Tensor, name) for name in READ_METHODS}
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, self._counted(name, original))
        self._equal = torch.equal
        torch.equal = self._counted("torch.equal", self._equal)
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for name, original in self._saved.items():
            setattr(torch.Tensor, name, original)
        torch.equal = self._equal

    def _counted(self, name: str, original: Callable) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(PACKAGE) and caller != __file__:
                self.add(f"{os.path.relpath(caller, os.path.dirname(PACKAGE))}:{sys._getframe(1).f_lineno} {name}")
            return original(*args, **kwargs)

        return counted


class OpCount(_Steps, TorchDispatchMode):
    """Counts, by step and by operator, the aten operators dispatched inside the `with` block (views apart)."""

    def __init__(self) -> None:
        _Steps.__init__(self)
        TorchDispatchMode.__init__(self)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not func.is_view:
            self.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def logging_steps(steps: int, log_every: int) -> list[int]:
    """The steps on which `train_loop` reads its figures: the first, every `log_every`-th, the last."""
    return sorted({0, steps - 1, *(s for s in range(steps) if log_every > 0 and (s + 1) % log_every == 0)})


def count_run(cfg: Any, ops: bool = True) -> dict[str, Any]:
    """Train `cfg` (a `TrainConfig`; on every rank when a process group exists) counting host reads and aten
    operators per step: {"reads": {step: n}, "ops": {step: n}, "sites": {step: {site: n}}, "logging": [steps]}.
    A step starts where the trainer fetches its batches (`minidist.train.loop.local_batches`, wrapped meanwhile)."""
    from minidist.train import loop

    reads, count = HostReads(), OpCount() if ops else None
    original = loop.local_batches

    def starting(*args: Any, **kwargs: Any) -> Any:
        reads.next_step()
        if count is not None:
            count.next_step()
        return original(*args, **kwargs)

    loop.local_batches = starting
    try:
        with reads, count if count is not None else contextlib.nullcontext():
            loop.train(cfg)
    finally:
        loop.local_batches = original
    steps = range(cfg.steps)
    return {"reads": {s: reads.total(s) for s in steps}, "ops": {s: count.total(s) if count else 0 for s in steps},
            "sites": {s: dict(reads.per_step.get(s, {})) for s in steps},
            "logging": logging_steps(cfg.steps, cfg.log_every)}
