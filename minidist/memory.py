"""Memory: what a rank holds and for how long (the trainer's peak, activation recomputation, tensor accounting).

* `peak_memory_bytes`: on CUDA `torch.cuda.max_memory_allocated` (the caching allocator's count of live tensor
  bytes at their peak). A CPU has no such counter, so the documented substitute is the process's peak resident set
  size (`getrusage(RUSAGE_SELF).ru_maxrss`): it also counts the interpreter, the libraries and freed-but-cached
  pages, so it is an upper bound of the tensor bytes, never below them.
* `apply_recompute`: activation checkpointing of every block (Chen et al. 2016, "Training Deep Nets with Sublinear
  Memory Cost"): the forward keeps only each block's input, the backward runs the block again to rebuild what it
  needs. Activation memory falls from every block's saved tensors to one [B, T, d] input per block, for one more
  forward per step (Korthikanti et al. 2022, §4: "full recomputation").
* `SavedTensorBytes`: the bytes autograd keeps for the backward (distinct storages), against `memory_model`.
* `LiveTensorBytes`: tensor accounting on any device: every tensor an operator creates is counted until its
  storage is freed, so `peak` and `current` are exact byte counts of what torch allocated inside the context.
* `PeakSavedBytes`: the bytes autograd holds for the backward at their peak: a saved storage counts from the first
  time it is saved until it is freed. With several micro-batches in flight (a pipeline) this is the activation
  memory the memory model (`memory_estimate`) predicts.
"""

from __future__ import annotations

import functools
import resource
import sys
import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import checkpoint


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far: CUDA tensor bytes on a GPU, peak resident set size on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS reports bytes, Linux kilobytes


def peak_memory_per_rank(device: torch.device, world_size: int) -> list[int]:
    """Every rank's `peak_memory_bytes`, in rank order (one small all-gather when world_size > 1)."""
    mine = torch.tensor([peak_memory_bytes(device)], dtype=torch.int64, device=device)
    if world_size == 1:
        return [int(mine.item())]
    out = torch.empty(world_size, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(out, mine)
    return [int(v) for v in out.tolist()]


def _recomputed_forward(forward, *args, **kwargs):
    # use_reentrant=False: the supported implementation; keeps the RNG state and works with keyword arguments.
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_recompute(model: nn.Module) -> nn.Module:
    """Recompute every block of `model.blocks` in the backward (in place; names and parameters unchanged).

    The block's own forward is wrapped, not the block replaced, so parameter names, the layout transformations
    that swap sub-modules (tensor, expert parallel) and pipeline stages that call blocks all keep working.
    """
    for block in model.blocks:
        block.forward = functools.partial(_recomputed_forward, block.forward)
    return model


class LiveTensorBytes(TorchDispatchMode):
    """Counts the bytes of every tensor storage created inside the context while it is alive: `current` now,
    `peak` the most at once. Storages that existed before (the parameters) are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self._seen: dict[int, weakref.ref] = {}

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._seen or storage.device.type == "meta":
            return
        size = storage.nbytes()
        self.current += size
        self.peak = max(self.peak, self.current)
        self._seen[key] = weakref.ref(storage, functools.partial(self._free, key, size))

    def _free(self, key: int, size: int, _ref: weakref.ref) -> None:
        self.current -= size
        self._seen.pop(key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or an in-place result shares an input's storage (a weight's transpose inside F.linear): no bytes.
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_sparse and t.untyped_storage()._cdata not in inputs:
                self._track(t)
        return out


class SavedTensorBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the bytes of the distinct storages autograd saves for the backward inside the context (`nbytes`),
    leaving out those of the tensors in `exclude` (parameters, buffers shared by every layer)."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}
        super().__init__(self._pack, lambda t: t)

    def __enter__(self) -> SavedTensorBytes:
        super().__enter__()
        return self

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self._skip:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


class PeakSavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """The bytes of the distinct storages saved for the backward that are alive at once: `current` and `peak`.

    A storage counts from the first time autograd saves it until it is freed (the backward that used it dropped it
    and nothing else holds it). The storages of `params` (read at every save: a ZeRO-3 unit gathered just in time
    is a parameter too; autograd saves a weight as a plain alias of the parameter, so the check is by storage)
    and of `exclude` (buffers shared by every layer) are not activations and are skipped."""

    def __init__(self, params: Iterable[torch.Tensor] = (), exclude: Iterable[torch.Tensor] = ()) -> None:
        self._params = list(params)
        self._skip = {t.untyped_storage().data_ptr() for t in exclude}
        self._live: dict[int, int] = {}
        self.current = self.peak = 0
        super().__init__(self._pack, lambda t: t)

    def __enter__(self) -> PeakSavedBytes:
        super().__enter__()
        return self

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key, ptr = storage._cdata, storage.data_ptr()
        if key in self._live or ptr in self._skip or storage.device.type == "meta" or not storage.nbytes():
            return t
        if any(p.untyped_storage().data_ptr() == ptr for p in self._params):
            return t
        size = storage.nbytes()
        self._live[key] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key, size)
        return t

    def _free(self, key: int, size: int) -> None:
        if self._live.pop(key, None) is not None:
            self.current -= size
