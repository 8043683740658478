"""Where ZeRO keeps the parameters, stage by stage; each home answers the same few questions for `ZeroOptimizer`.

- `ParamHome` (stage 0): in the model, whole, on every rank; the optimizer updates them in place. Its answers are
  the defaults of the other two.
- `FlatParams` (stages 1-2): in the model, whole, on every rank, as views of one flat buffer per bucket. The
  optimizer updates this rank's slice of each buffer (`bucket.param_shard`, a view), and one all-gather per bucket
  after the step brings every rank the others' updated slices.
- `ShardedParams` (stage 3): only this rank's slice lives; the model's parameters are empty tensors. Each unit (a
  transformer block, and the "root": everything outside the blocks) is all-gathered just before its forward and
  freed after it, all-gathered again just before its backward (a hook on its output's gradient) and freed once its
  gradients are on their way (`release`, called when the unit's reduce-scatter is launched).

Freeing a gathered unit resizes its buffer's storage to 0 bytes: autograd may have saved views of a weight (the
transpose a matmul keeps for backward), and views share the storage, so they are freed too and see the re-gathered
values before backward needs them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from minidist.comm.communicator import Comm, Handle
from minidist.memory import PeakBytes
from minidist.parallel.dp.data_parallel import Bucket


class ParamHome:
    """Stage 0: nothing to move; every rank updates the whole model the same way."""

    def after_step(self) -> None:
        """Nothing: the optimizer updated the parameters in place."""

    def release(self, bucket: Bucket) -> None:
        """Nothing: the parameters stay."""

    def buffers(self) -> list[torch.Tensor]:
        return []

    def iter_full(self, named: Sequence[tuple[str, nn.Parameter]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full value) in the order of `named`: here the model's own tensors, whole."""
        for name, param in named:
            yield name, param.detach()

    def state_dict(self) -> dict:
        return {}  # the model's state dict holds them

    def load_state_dict(self, state: dict) -> None:
        pass


class FlatParams(ParamHome):
    """Stages 1-2: the parameters become views of one flat buffer per bucket; each rank updates its slice."""

    def __init__(self, buckets: list[Bucket], comm: Comm) -> None:
        self.buckets = buckets
        self.comm = comm
        for bucket in buckets:
            bucket.param_flat = torch.zeros(bucket.padded, dtype=bucket.params[0].dtype,
                                            device=bucket.params[0].device)
            for view, param in zip(bucket.views(bucket.param_flat), bucket.params):
                view.copy_(param.detach())
                param.data = view
            start, stop = bucket.shard_range(comm.rank, comm.size)
            bucket.param_shard = bucket.param_flat[start:stop]

    def after_step(self) -> None:
        # The source is a copy: the output buffer contains the shard, and a collective must not read what it writes.
        handles = [self.comm.all_gather(b.param_shard.clone(), out=b.param_flat, async_op=True) for b in self.buckets]
        for handle in handles:
            handle.wait()

    def buffers(self) -> list[torch.Tensor]:
        return [b.param_flat for b in self.buckets]


class _Unit:
    """A stage-3 gather unit: its bucket (the flat layout, and `param_shard`) and the gathered full buffer, whose
    storage exists only while the unit is gathered."""

    def __init__(self, bucket: Bucket, comm: Comm, gather_dtype: torch.dtype | None = None) -> None:
        self.bucket = bucket
        params = bucket.params
        flat = torch.zeros(bucket.padded, dtype=params[0].dtype, device=params[0].device)
        for view, param in zip(bucket.views(flat), params):
            view.copy_(param.detach())
        start, stop = bucket.shard_range(comm.rank, comm.size)
        bucket.param_shard = flat[start:stop].clone()  # the master slice, in the parameters' dtype
        # The gathered copy, in the policy's gather dtype (`precision.CommPrecision`): what forward and backward see.
        self.full = torch.zeros(bucket.padded, dtype=gather_dtype or params[0].dtype, device=params[0].device)
        self.views = bucket.views(self.full)
        self.full.untyped_storage().resize_(0)
        for param in params:
            param.data = torch.empty(0, dtype=params[0].dtype, device=params[0].device)
        self.pending: Handle | None = None  # an all-gather in flight (a prefetch)
        self.gathered = False


class ShardedParams(ParamHome):
    """Stage 3: each unit's parameters live as a flat shard; hooks gather a unit for its forward and backward.

    `buckets[i]` holds the parameters of module `modules[i]` (None: the root, i.e. the model minus the other
    units); buckets are in backward order. The forward order is root, then the modules in order; backward runs the
    modules in reverse, the root first (its output, the logits, is where backward starts) and last (the embedding).
    """

    def __init__(self, model: nn.Module, comm: Comm, buckets: list[Bucket], modules: list[nn.Module | None],
                 transient: PeakBytes, prefetch: bool = True, gather_dtype: torch.dtype | None = None) -> None:
        self.comm = comm
        self.buckets = buckets
        self.transient = transient
        self.prefetch = prefetch
        self.units = [_Unit(bucket, comm, gather_dtype) for bucket in buckets]
        roots = [u for u, m in zip(self.units, modules) if m is None]  # the root unit, if it has parameters
        blocks = [u for u, m in zip(self.units, modules) if m is not None]
        self.forward_order = [*roots, *reversed(blocks)]
        self.backward_order = [*roots, *blocks]
        for unit, module in zip(self.units, modules):
            target = model if module is None else module
            target.register_forward_pre_hook(self._pre_forward_hook(unit))
            target.register_forward_hook(self._post_forward_hook(unit))

    # -- what ZeroOptimizer asks ----------------------------------------------------------------------------------

    def release(self, bucket: Bucket) -> None:
        self._free(self.units[bucket.index])  # buckets are numbered in order

    def buffers(self) -> list[torch.Tensor]:
        return [b.param_shard for b in self.buckets] + [u.full for u in self.units]

    def iter_full(self, named: Sequence[tuple[str, nn.Parameter]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full value: a copy) in the order of `named`, all-gathering one unit at a time (collective: every
        rank of the group iterates to the end). The unit holding the current parameter is the only one gathered,
        so at most a unit (plus the copy last yielded) lives beside the shards; a unit whose parameters are not
        consecutive in `named` (the root: embedding first, head last) is gathered once per run of them."""
        home = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        current, views = None, []
        for name, param in named:
            bucket, i = home[id(param)]
            if bucket is not current:
                views = []  # drop the previous unit before gathering the next
                current, views = bucket, bucket.views(self.comm.all_gather(bucket.param_shard))
            yield name, views[i].clone()

    def state_dict(self) -> dict:
        return {"param_shards": [b.param_shard.clone() for b in self.buckets]}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for bucket, shard in zip(self.buckets, state["param_shards"]):
            bucket.param_shard.copy_(shard)

    # -- gather / free --------------------------------------------------------------------------------------------

    def _start_gather(self, unit: _Unit) -> None:
        if unit.gathered or unit.pending is not None:
            return
        unit.full.untyped_storage().resize_(unit.full.numel() * unit.full.element_size())
        self.transient.add(unit.full.nbytes)
        shard = unit.bucket.param_shard.to(unit.full.dtype)  # no copy when the policy gathers the master dtype
        unit.pending = self.comm.all_gather(shard, out=unit.full, async_op=True)

    def _gather(self, unit: _Unit) -> None:
        """Make the unit's full parameters available (wait for a prefetch, or gather now)."""
        if unit.gathered:
            return
        self._start_gather(unit)
        unit.pending.wait()
        unit.pending = None
        for param, view in zip(unit.bucket.params, unit.views):
            param.data = view
        unit.gathered = True

    def _free(self, unit: _Unit) -> None:
        if unit.pending is not None:  # a prefetch nobody used: finish it so the collective order stays aligned
            self._gather(unit)
        if not unit.gathered:
            return
        empty = torch.empty(0, dtype=unit.bucket.param_shard.dtype, device=unit.full.device)  # at rest: master dtype
        for param in unit.bucket.params:
            param.data = empty
        self.transient.sub(unit.full.nbytes)
        unit.full.untyped_storage().resize_(0)
        unit.gathered = False

    def _prefetch_after(self, order: list[_Unit], unit: _Unit) -> None:
        if self.prefetch:
            i = order.index(unit)
            if i + 1 < len(order):
                self._start_gather(order[i + 1])

    # -- hooks ----------------------------------------------------------------------------------------------------

    def _pre_forward_hook(self, unit: _Unit):
        def hook(module: nn.Module, args: tuple) -> None:
            self._gather(unit)
            self._prefetch_after(self.forward_order, unit)
        return hook

    def _post_forward_hook(self, unit: _Unit):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self._free(unit)
            outputs = [output] if isinstance(output, torch.Tensor) else [o for o in output
                                                                       if isinstance(o, torch.Tensor)]
            outputs = [o for o in outputs if o.requires_grad]
            if outputs:  # backward will need the parameters again: gather when the output's gradient arrives
                def before_backward(grad: torch.Tensor) -> None:
                    self._gather(unit)
                    self._prefetch_after(self.backward_order, unit)
                outputs[0].register_hook(before_backward)
        return hook


def default_units(model: nn.Module) -> list[nn.Module]:
    """ZeRO-3's gather units, in forward order: the transformer blocks (`model.blocks`), if the model has them; else
    none (everything is the root).

    A pipeline stage holds some blocks (None in the others' places) and calls itself once per chunk: its embedding
    (with the first block) and its final norm and head (with the last) are units of their own, so that a chunk
    gathers only what it runs and the root is empty (a tied weight then sits alone in the head's unit)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        return []
    held = [b for b in blocks if b is not None]
    if len(held) == len(blocks):
        return held
    ends = lambda names: [getattr(model, n) for n in names if getattr(model, n, None) is not None]  # noqa: E731
    first = ends(("tok_emb", "pos_emb")) if blocks[0] is not None else []
    last = ends(("norm", "lm_head")) if blocks[-1] is not None else []
    return [*first, *held, *last]


def unit_buckets(named: list[tuple[str, nn.Parameter]], modules: list[nn.Module | None],
                 world: int) -> tuple[list[Bucket], list[nn.Module | None]]:
    """One bucket per unit (in backward order) and its module; a parameter goes to the first unit containing it."""
    owner: dict[int, int] = {}
    for i, module in enumerate(modules):
        if module is not None:
            for p in module.parameters():
                owner.setdefault(id(p), i)
    root = modules.index(None)
    groups: list[list[tuple[str, nn.Parameter]]] = [[] for _ in modules]
    for name, param in named:
        groups[owner.get(id(param), root)].append((name, param))
    # A unit without parameters of its own is dropped; so is an empty root (e.g. a middle pipeline stage).
    kept = [(g, m) for g, m in zip(groups, modules) if g]
    return [Bucket(i, g, pad_to=world) for i, (g, _) in enumerate(kept)], [m for _, m in kept]
