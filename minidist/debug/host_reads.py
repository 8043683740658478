"""What a GPU step pays for that a CPU run hides, counted on the CPU: the reads of tensor values on the host by the
package's own code, and the aten operators a step runs.

A read of a tensor's value on the host (`.item()`, `.tolist()`, `float(t)`, `int(t)`, `if t:`, `.cpu()`,
`.numpy()`, a tensor used as an index, `torch.equal`) waits on a GPU for every kernel queued before it: the host
stops feeding the device. On a CPU it costs nothing, so nothing shows it. `HostReads` replaces these methods of
`torch.Tensor` for the duration of a `with` block and counts the calls whose caller is a file of `minidist/` (torch's
own reads, and the caller's, are not the package's). `OpCount` counts the aten operators dispatched (views apart:
a view launches no kernel), what a GPU launches one kernel each for when nothing fuses them.

Three more kinds of wait a CPU hides, each counted under its own name (`kind` of a site):
- "copy": a `Tensor.to(...)` naming a device, by the package's code, without `non_blocking=True`. On CUDA a copy
  to the host always waits for the stream, and a copy from pageable host memory to the GPU is staged and waited
  for too; only pinned memory with non_blocking is queued like a kernel (the trainer's batches: `loop.to_device`).
- "sync": a stream or device synchronization (`torch.cuda.synchronize`, `Stream.synchronize`,
  `Event.synchronize`, and the package's `minidist.train.metrics.synchronize`, a no-op on a CPU).
- "shape" (`OpCount`): an aten operator whose output size depends on tensor values (`nonzero`, `masked_select`,
  boolean indexing, `repeat_interleave` without `output_size`, `unique`, `bincount`, ...): on CUDA it reads that
  size on the host, from any caller (torch's code included).

All sort their counts by step: `next_step()` starts a new step (the benchmark `bench/syncs.py` calls it where the
trainer starts each step), and `per_step` holds one count per step (index -1: before the first).
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import weakref
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


def target_device(args: tuple, kwargs: dict) -> torch.device | None:
    """The device a `Tensor.to(*args, **kwargs)` call names (a device, a device string, a tensor's), else None."""
    for t in (*args[1:2], kwargs.get("device"), kwargs.get("other")):
        if isinstance(t, torch.Tensor):
            return t.device
        if isinstance(t, (str, torch.device)):
            with contextlib.suppress(RuntimeError):
                return torch.device(t)
    return None


SYNC_CALLS = ((torch.cuda, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda.Event, "synchronize"))


class HostReads(_Steps):
    """Counts, by step and by site ("path:line method"), the host reads of tensor values made by `minidist/`, the
    blocking copies ("path:line to copy") and the stream syncs ("... synchronize sync") (module docstring);
    `kinds[step]` sums the sites by kind: "read", "copy", "sync".

    A copy is a `.to(...)` naming a device, without non_blocking, that moves data here (another device) or whose
    source is in `host`: the tensors that live on the host on any device (the sampler's rows, the document ids made
    from them; `count_run` adds them). A `.to(device)` of a tensor already there is no copy on any machine."""

    def __init__(self) -> None:
        super().__init__()
        self.host: dict[int, weakref.ref] = {}  # by id: a tensor's == is element-wise

    def add_host(self, tensor: torch.Tensor) -> None:
        self.host[id(tensor)] = weakref.ref(tensor)

    def on_host(self, tensor: torch.Tensor) -> bool:
        ref = self.host.get(id(tensor))
        return ref is not None and ref() is tensor

    def _blocking_copy(self, args: tuple, kwargs: dict) -> bool:
        device = target_device(args, kwargs)
        blocking = not kwargs.get("non_blocking", False) and not (len(args) > 2 and args[2] is True)
        return device is not None and blocking and (args[0].device != device or self.on_host(args[0]))

    def __enter__(self) -> HostReads:
        from minidist.train import metrics

        self.kinds: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self._saved = [(torch.Tensor, name, "read", None) for name in READ_METHODS] + [
            (torch, "equal", "read", None), (torch.Tensor, "to", "copy", self._blocking_copy),
            (metrics, "synchronize", "sync", None)] + [(owner, name, "sync", None) for owner, name in SYNC_CALLS]
        self._saved = [(owner, name, kind, when, getattr(owner, name)) for owner, name, kind, when in self._saved]
        for owner, name, kind, when, original in self._saved:
            label = name if owner is torch.Tensor else f"{owner.__name__}.{name}"
            setattr(owner, name, self._counted(label, kind, original, when))
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for owner, name, _, _, original in self._saved:
            setattr(owner, name, original)

    def total(self, step: int, kind: str = "read") -> int:
        return self.kinds.get(step, {}).get(kind, 0)

    def _counted(self, name: str, kind: str, original: Callable, when: Callable | None) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code.co_filename
            package = caller.startswith(PACKAGE) and caller != __file__
            if (package or kind == "sync") and (when is None or when(args, kwargs)):
                where = os.path.relpath(caller, os.path.dirname(PACKAGE)) if package else "torch"
                self.add(f"{where}:{sys._getframe(1).f_lineno} {name}{'' if kind == 'read' else ' ' + kind}")
                self.kinds[self.step][kind] += 1
            return original(*args, **kwargs)

        return counted


SHAPE_OPS = frozenset({"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
                       "unique_dim", "bincount", "histc", "masked_scatter"})
# Not `_local_scalar_dense` (`.item()`): a read of a host tensor waits for nothing (torch's AdamW reads its step
# counters, kept on the host); the package's reads are the "read" sites, whatever tensor they read.


def sizes_from_values(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether this aten call's output size depends on tensor values (a host read of a size on CUDA): the ops of
    SHAPE_OPS, an index or index_put with a boolean mask, a repeat_interleave of tensor repeats without
    output_size."""
    name = func.overloadpacket.__name__
    if name in SHAPE_OPS:
        return True
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else ()))
    if name == "repeat_interleave":
        return isinstance(args[1] if len(args) > 1 else args[0], torch.Tensor) and kwargs.get("output_size") is None
    return False


class OpCount(_Steps, TorchDispatchMode):
    """Counts, by step and by operator, the aten operators dispatched inside the `with` block (views apart), and in
    `shape` by step the ones whose output size comes from tensor values (`sizes_from_values`), by operator in
    `shape_ops`."""

    def __init__(self) -> None:
        _Steps.__init__(self)
        TorchDispatchMode.__init__(self)
        self.shape: collections.Counter = collections.Counter()
        self.shape_ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not func.is_view:
            self.add(str(func.overloadpacket))
        if sizes_from_values(func, args, kwargs):
            self.shape[self.step] += 1
            self.shape_ops[str(func.overloadpacket)] += 1
        return func(*args, **kwargs)


def logging_steps(steps: int, log_every: int) -> list[int]:
    """The steps on which `train_loop` reads its figures: the first, every `log_every`-th, the last."""
    return sorted({0, steps - 1, *(s for s in range(steps) if log_every > 0 and (s + 1) % log_every == 0)})


def count_run(cfg: Any, ops: bool = True) -> dict[str, Any]:
    """Train `cfg` (a `TrainConfig`; on every rank when a process group exists) counting host reads, blocking
    copies, stream syncs, aten operators and data-sized operators per step: {"reads"|"copies"|"syncs"|"ops"|"shape":
    {step: n}, "sites": {step: {site: n}}, "logging": [steps]}.
    A step starts where the trainer fetches its batches (`minidist.train.loop.local_batches`, wrapped meanwhile)."""
    from minidist.data.sampler import BatchSampler
    from minidist.train import loop

    reads, count = HostReads(), OpCount() if ops else None
    original, rows, doc_ids = loop.local_batches, BatchSampler._rows, loop.document_ids

    def on_host(make: Callable) -> Callable:
        def made(*args: Any, **kwargs: Any) -> Any:
            out = make(*args, **kwargs)
            for tensor in out if isinstance(out, tuple) else (out,):
                reads.add_host(tensor)
            return out

        return made

    def starting(*args: Any, **kwargs: Any) -> Any:
        reads.next_step()
        if count is not None:
            count.next_step()
        return original(*args, **kwargs)

    loop.local_batches, BatchSampler._rows, loop.document_ids = starting, on_host(rows), on_host(doc_ids)
    try:
        with reads, count if count is not None else contextlib.nullcontext():
            loop.train(cfg)
    finally:
        loop.local_batches, BatchSampler._rows, loop.document_ids = original, rows, doc_ids
    steps = range(cfg.steps)
    return {"reads": {s: reads.total(s) for s in steps}, "ops": {s: count.total(s) if count else 0 for s in steps},
            "copies": {s: reads.total(s, "copy") for s in steps}, "syncs": {s: reads.total(s, "sync") for s in steps},
            "shape": {s: count.shape[s] if count else 0 for s in steps},
            "sites": {s: dict(reads.per_step.get(s, {})) for s in steps},
            "logging": logging_steps(cfg.steps, cfg.log_every)}
