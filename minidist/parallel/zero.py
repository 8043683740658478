"""ZeRO: data parallelism that stops replicating the model states (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models").

Plain data parallelism keeps on every rank the parameters, the gradients and the optimizer state of the whole model:
(P + G + K)·Ψ bytes for Ψ parameters (P, G bytes per parameter and gradient, K bytes of optimizer state). ZeRO
partitions them over the N_d ranks of the data-parallel group, in three stages (§5, Figure 1):

    stage 1 (P_os)       optimizer state sharded          P·Ψ + G·Ψ + K·Ψ/N_d
    stage 2 (P_os+g)     + gradients reduce-scattered     P·Ψ + (G + K)·Ψ/N_d
    stage 3 (P_os+g+p)   + parameters sharded             (P + G + K)·Ψ/N_d

The paper's mixed-precision figures are P = G = 2 (fp16) and K = 12 (fp32 master weights, momentum, variance).
Our fp32 training needs no master copy: P = G = 4, K = 8.

How each stage is built here, on flat buffers (several parameters side by side, padded so N_d divides them; rank r
owns the r-th equal slice of each):

- The optimizer is the caller's own (e.g. torch.optim.AdamW), rebuilt over *pieces*: the slices of this rank's shard
  that belong to each parameter, in the same param groups. AdamW is elementwise, so updating the pieces is exactly
  the update the full optimizer would make (bit for bit).
- Stage 1: gradients accumulate in full fp32 buckets; after the last micro-batch each bucket is reduce-scattered
  (rank r receives the average of its slice), the optimizer updates its slice, and the parameters are all-gathered.
  Bytes per step: reduce-scatter + all-gather = one all-reduce, as in plain data parallelism (§7.2.1).
- Stage 2: every micro-batch's buckets are reduce-scattered as soon as they fill and added into a persistent
  gradient shard; a bucket's full buffer lives only while it is in flight.
- Stage 3: parameters live as shards. Each unit (a transformer block, and the "root": everything outside the blocks)
  is all-gathered just before its forward and freed after it, all-gathered again just before its backward (a hook
  on its output's gradient) and freed once its gradients are reduce-scattered. Bytes per micro-batch: 2 all-gathers
  + 1 reduce-scatter = 1.5x plain data parallelism (§7.2.2).

Freeing a gathered unit resizes its buffer's storage to 0 bytes: autograd may have saved views of a weight (the
transpose a matmul keeps for backward), and views share the storage, so they are freed too and see the re-gathered
values before backward needs them.

Global-norm clipping: each rank sums the squares of its gradient shard, one all-reduce adds the sums; no gradient
element is counted twice (padding is zero).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from minidist.comm import Comm
from minidist.parallel.data_parallel import DEFAULT_BUCKET_BYTES, Bucket, DataParallel, Timeline, assign_buckets

# ---------------------------------------------------------------------------------------------------------------
# Formulas
# ---------------------------------------------------------------------------------------------------------------


def zero_memory_bytes(n_params: int, dp: int, stage: int, optimizer_bytes_per_param: float = 12,
                      param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Model-state bytes per rank at ZeRO `stage` (Rajbhandari et al. 2020, §5, Figure 1).

    Defaults are the paper's mixed precision: (2 + 2 + K)·Ψ for the baseline with K = 12. For fp32 training with
    Adam pass param_bytes=4, grad_bytes=4, optimizer_bytes_per_param=8.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if dp < 1 or n_params < 0:
        raise ValueError(f"need dp >= 1 and n_params >= 0, got dp={dp}, n_params={n_params}")
    psi, p, g, k = n_params, param_bytes, grad_bytes, optimizer_bytes_per_param
    sharded = {0: 0.0, 1: k, 2: g + k, 3: p + g + k}[stage]
    return (p + g + k - sharded) * psi + sharded * psi / dp


def zero_comm_bytes(n_params: int, dp: int, stage: int, microbatches: int = 1,
                    element_size: int = 4) -> dict[str, float]:
    """Bytes each rank sends per optimizer step, by collective, for `n_params` elements (ring algorithms).

    all-reduce sends 2(N-1)/N·M, reduce-scatter and all-gather (N-1)/N·M each, M = Ψ·element_size:
        stage 0   all-reduce once (gradient accumulation communicates on the last micro-batch only)
        stage 1   reduce-scatter once + all-gather of the updated parameters once
        stage 2   reduce-scatter every micro-batch + all-gather once
        stage 3   per micro-batch: all-gather for forward, all-gather for backward, reduce-scatter
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    one = (dp - 1) / dp * n_params * element_size
    m = microbatches
    return {0: {"all_reduce": 2 * one},
            1: {"reduce_scatter": one, "all_gather": one},
            2: {"reduce_scatter": m * one, "all_gather": one},
            3: {"reduce_scatter": m * one, "all_gather": 2 * m * one}}[stage]


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors`: a view into a flat buffer is not counted twice."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class _Transient:
    """Bytes of the short-lived buffers (gathered units, in-flight gradient buckets): now and at the peak."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def sub(self, nbytes: int) -> None:
        self.now -= nbytes


# ---------------------------------------------------------------------------------------------------------------
# Gradients: reduce-scatter into shards (stages 1-3)
# ---------------------------------------------------------------------------------------------------------------


class _ShardedGrads(DataParallel):
    """DataParallel with the all-reduce replaced by a reduce-scatter: rank r keeps the average of its slice.

    Stage 1 keeps full fp32 buckets (accumulating over micro-batches) and writes the reduced slice back into its own
    slice of the bucket. Stages 2 and 3 allocate a bucket per backward, reduce-scatter it as soon as it fills, add
    the result into a persistent shard and drop the bucket.
    """

    def __init__(self, model: nn.Module, comm: Comm, stage: int, buckets: list[Bucket], transient: _Transient,
                 overlap: bool, timeline: Timeline | None) -> None:
        self.stage = stage
        self.sync_every_microbatch = stage >= 2
        self.transient = transient
        self.on_bucket_done: Callable[[Bucket], None] | None = None  # stage 3: free the unit's parameters
        self.on_backward_end: Callable[[], None] | None = None  # stage 3: free whatever is still gathered
        self.max_in_flight = 1
        self._in_flight: list[Bucket] = []
        super().__init__(model, comm, overlap=overlap, timeline=timeline, buckets=buckets)

    def _allocate_grad_buffers(self) -> None:
        for bucket in self.buckets:
            device = bucket.params[0].device
            start, stop = bucket.shard_range(self.comm.rank, self.comm.size)
            if self.stage == 1:
                bucket.grad = torch.zeros(bucket.padded, dtype=self.reduce_dtype, device=device)
                bucket.grad_views = bucket.views(bucket.grad)
                bucket.grad_shard = bucket.grad[start:stop]
            else:
                bucket.grad = None
                bucket.grad_shard = torch.zeros(stop - start, dtype=self.reduce_dtype, device=device)

    def _grad_buffer(self, bucket: Bucket) -> torch.Tensor:
        if bucket.grad is None:
            bucket.grad = torch.zeros(bucket.padded, dtype=self.reduce_dtype, device=bucket.params[0].device)
            bucket.grad_views = bucket.views(bucket.grad)
            self.transient.add(bucket.grad.nbytes)
        return bucket.grad

    def _reset(self) -> None:
        for bucket in self.buckets:
            for param in bucket.params:
                param.grad = None
            if self.stage == 1:
                bucket.grad.zero_()
            else:
                bucket.grad_shard.zero_()
        self._stale = False

    def _launch(self, bucket: Bucket) -> None:
        super()._launch(bucket)
        if self.stage >= 2:
            # Bound the buckets in flight: their full buffers are the transient memory of stages 2-3. (gloo runs a
            # reduce-scatter inside wait(), so without this bound every bucket would stay alive until backward ends.)
            self._in_flight.append(bucket)
            while len(self._in_flight) > self.max_in_flight:
                self._complete(self._in_flight.pop(0))

    def _complete_all(self) -> None:
        super()._complete_all()
        self._in_flight.clear()

    def _start_collective(self, bucket: Bucket):
        flat = self._grad_buffer(bucket)
        bucket.reduced = torch.empty_like(bucket.grad_shard)
        handle = self.comm.reduce_scatter(flat, out=bucket.reduced, op="avg", async_op=True)
        if self.on_bucket_done is not None:
            self.on_bucket_done(bucket)
        return handle

    def _complete(self, bucket: Bucket) -> None:
        if bucket.handle is None:
            return
        self._wait(bucket)
        if self.stage == 1:
            bucket.grad_shard.copy_(bucket.reduced)
        else:
            bucket.grad_shard.add_(bucket.reduced)
            self.transient.sub(bucket.grad.nbytes)
            bucket.grad, bucket.grad_views = None, []
        bucket.reduced = None

    def _after_backward(self) -> None:
        if self.sync_every_microbatch:  # the shard must hold this micro-batch before the next one starts
            self._complete_all()
        if self.on_backward_end is not None:
            self.on_backward_end()

    def _publish(self) -> None:
        """Nothing: the optimizer reads the gradient shards directly."""


# ---------------------------------------------------------------------------------------------------------------
# Parameters: sharded, gathered just in time (stage 3)
# ---------------------------------------------------------------------------------------------------------------


class _ShardedParams:
    """Stage 3: each unit's parameters live as a flat shard; hooks gather a unit for its forward and backward.

    `units[i]` is the Bucket of module `modules[i]` (None: the root, i.e. the model minus the other units). The
    forward order is root, then the modules in order; backward runs the modules in reverse, the root first (its
    output, the logits, is where backward starts) and last (the embedding).
    """

    def __init__(self, model: nn.Module, comm: Comm, units: list[Bucket], modules: list[nn.Module | None],
                 transient: _Transient, prefetch: bool = True) -> None:
        self.comm = comm
        self.units = units
        self.transient = transient
        self.prefetch = prefetch
        rank, world = comm.rank, comm.size
        for unit in units:
            device, dtype = unit.params[0].device, unit.params[0].dtype
            full = torch.zeros(unit.padded, dtype=dtype, device=device)
            for view, param in zip(unit.views(full), unit.params):
                view.copy_(param.detach())
            start, stop = unit.shard_range(rank, world)
            unit.param_shard = full[start:stop].clone()
            unit.full = full  # the gathered layout; its storage is resized to 0 while the unit is not gathered
            unit.full_views = unit.views(full)
            full.untyped_storage().resize_(0)
            for param in unit.params:
                param.data = torch.empty(0, dtype=dtype, device=device)
            unit.gathered = False
            unit.pending = None
        roots = [u for u, m in zip(units, modules) if m is None]  # the root unit, if it has parameters
        backward_blocks = [u for u, m in zip(units, modules) if m is not None]  # units are in backward order
        self.forward_order = [*roots, *reversed(backward_blocks)]
        self.backward_order = [*roots, *backward_blocks]
        self._hooks = []
        for unit, module in zip(units, modules):
            target = model if module is None else module
            self._hooks.append(target.register_forward_pre_hook(self._pre_forward_hook(unit)))
            self._hooks.append(target.register_forward_hook(self._post_forward_hook(unit)))

    # -- gather / free --------------------------------------------------------------------------------------------

    def _start_gather(self, unit: Bucket) -> None:
        if unit.gathered or unit.pending is not None:
            return
        unit.full.untyped_storage().resize_(unit.padded * unit.full.element_size())
        self.transient.add(unit.full.nbytes)
        unit.pending = self.comm.all_gather(unit.param_shard, out=unit.full, async_op=True)

    def gather(self, unit: Bucket) -> None:
        """Make the unit's full parameters available (wait for a prefetch, or gather now)."""
        if unit.gathered:
            return
        self._start_gather(unit)
        unit.pending.wait()
        unit.pending = None
        for param, view in zip(unit.params, unit.full_views):
            param.data = view
        unit.gathered = True

    def _free(self, unit: Bucket) -> None:
        if not unit.gathered:
            return
        empty = torch.empty(0, dtype=unit.full.dtype, device=unit.full.device)
        for param in unit.params:
            param.data = empty
        self.transient.sub(unit.full.nbytes)
        unit.full.untyped_storage().resize_(0)
        unit.gathered = False

    def free(self, unit: Bucket) -> None:
        if unit.pending is not None:  # a prefetch nobody used: finish it so the collective order stays aligned
            self.gather(unit)
        self._free(unit)

    def free_all(self) -> None:
        for unit in self.units:
            self.free(unit)

    def _prefetch_after(self, order: list[Bucket], unit: Bucket) -> None:
        if self.prefetch:
            i = order.index(unit)
            if i + 1 < len(order):
                self._start_gather(order[i + 1])

    # -- hooks ----------------------------------------------------------------------------------------------------

    def _pre_forward_hook(self, unit: Bucket):
        def hook(module: nn.Module, args: tuple) -> None:
            self.gather(unit)
            self._prefetch_after(self.forward_order, unit)
        return hook

    def _post_forward_hook(self, unit: Bucket):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.free(unit)
            outputs = [output] if isinstance(output, torch.Tensor) else [o for o in output
                                                                       if isinstance(o, torch.Tensor)]
            outputs = [o for o in outputs if o.requires_grad]
            if outputs:  # backward will need the parameters again: gather when the output's gradient arrives
                def before_backward(grad: torch.Tensor) -> None:
                    self.gather(unit)
                    self._prefetch_after(self.backward_order, unit)
                outputs[0].register_hook(before_backward)
        return hook


# ---------------------------------------------------------------------------------------------------------------
# The optimizer over shards, and what the trainer holds
# ---------------------------------------------------------------------------------------------------------------


def default_units(model: nn.Module) -> list[nn.Module]:
    """ZeRO-3's gather units: the transformer blocks (`model.blocks`), if the model has them; else none (the root)."""
    return list(model.blocks) if isinstance(getattr(model, "blocks", None), nn.ModuleList) else []


class ZeroOptimizer:
    """Data parallelism at ZeRO `stage` (0-3) over `comm`: gradient reduction, a sharded optimizer, clipping.

    `optimizer` is the unsharded optimizer you would use on one device (e.g. AdamW over param groups); it serves as
    a template: its class, hyperparameters and param groups are rebuilt over this rank's shard (stage 0 uses it as
    it is). It must not have taken a step yet. Use it where a torch optimizer goes:

        zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=...), topo.comm("dp_cp", ledger), 2)
        for i, (x, y) in enumerate(micro_batches):
            with zero.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                (lm_loss(model(x), y) / len(micro_batches)).backward()
        grad_norm = zero.clip_grad_norm(1.0)
        zero.step()
        zero.zero_grad()

    Stages 2 and 3 reduce every micro-batch (`no_sync` changes nothing there): skipping would need a full gradient.
    Stage 3 needs the model called as a whole (its forward hooks gather the parameters); `model.state_dict()` then
    holds empty tensors: the parameters are in `state_dict()` of this object (or `full_parameters()`).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm, stage: int = 1, *,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, units: Sequence[nn.Module] | None = None,
                 overlap: bool = True, prefetch: bool = True, timeline: Timeline | None = None) -> None:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        if any(optimizer.state.values()):
            raise ValueError("the template optimizer already has state; build ZeroOptimizer before the first step")
        self.model, self.comm, self.stage = model, comm, stage
        self.transient = {"gathered_params": _Transient(), "grad_buckets": _Transient()}
        self.sharded_params: _ShardedParams | None = None
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.numel = sum(p.numel() for _, p in named)
        if stage == 0:
            self.grads = DataParallel(model, comm, bucket_bytes=bucket_bytes, overlap=overlap, timeline=timeline)
            self.buckets = self.grads.buckets
            self.optimizer = optimizer
            return
        if stage == 3:
            modules = [*reversed(list(units if units is not None else default_units(model))), None]
            buckets, modules = _unit_buckets(named, modules, comm.size)
        else:
            buckets = assign_buckets(named, bucket_bytes, pad_to=comm.size)
            for bucket in buckets:  # parameters become views of one flat buffer per bucket
                bucket.param_flat = torch.zeros(bucket.padded, dtype=bucket.params[0].dtype,
                                                device=bucket.params[0].device)
                for view, param in zip(bucket.views(bucket.param_flat), bucket.params):
                    view.copy_(param.detach())
                    param.data = view
        self.buckets = buckets
        self.grads = _ShardedGrads(model, comm, stage, buckets, self.transient["grad_buckets"], overlap, timeline)
        if stage == 3:
            self.sharded_params = _ShardedParams(model, comm, buckets, modules, self.transient["gathered_params"],
                                                 prefetch)
            self.grads.on_bucket_done = self.sharded_params.free
            self.grads.on_backward_end = self.sharded_params.free_all
        self.optimizer = self._shard_optimizer(optimizer)

    # -- construction ---------------------------------------------------------------------------------------------

    def _master_shard(self, bucket: Bucket) -> torch.Tensor:
        if self.stage == 3:
            return bucket.param_shard
        start, stop = bucket.shard_range(self.comm.rank, self.comm.size)
        return bucket.param_flat[start:stop]

    def _shard_optimizer(self, template: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The template's optimizer class and param groups, over this rank's slices of each parameter."""
        group_of = {id(p): i for i, g in enumerate(template.param_groups) for p in g["params"]}
        pieces: list[list[torch.Tensor]] = [[] for _ in template.param_groups]
        self.pieces: list[tuple[str, int, int]] = []  # (parameter name, first, last element) held by this rank
        for bucket in self.buckets:
            start, stop = bucket.shard_range(self.comm.rank, self.comm.size)
            master, grad = self._master_shard(bucket), bucket.grad_shard
            for name, param, offset, n in zip(bucket.names, bucket.params, bucket.offsets, bucket.numels):
                if id(param) not in group_of:
                    raise ValueError(f"parameter {name} requires grad but is not in the optimizer")
                lo, hi = max(offset, start), min(offset + n, stop)
                if lo >= hi:
                    continue
                piece = master[lo - start:hi - start]
                piece.grad = grad[lo - start:hi - start]
                pieces[group_of[id(param)]].append(piece)
                self.pieces.append((name, lo - offset, hi - offset))
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": p}
                  for g, p in zip(template.param_groups, pieces)]
        accepted = inspect.signature(type(template).__init__).parameters
        return type(template)(groups, **{k: v for k, v in template.defaults.items() if k in accepted})

    # -- the optimizer's face -------------------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def padded_numel(self) -> int:
        """Elements in the flat layouts, padding included (what the collectives carry)."""
        return sum(b.padded for b in self.buckets)

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for the micro-batches before the last (stages 0-1 skip communication inside it)."""
        return self.grads.no_sync()

    def finish_grad_sync(self) -> None:
        self.grads.finish_grad_sync()

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale the gradients to a global L2 norm of at most `max_norm` (0: no clipping); return the norm before.

        Same rule as torch.nn.utils.clip_grad_norm_: multiply by min(1, max_norm / (norm + 1e-6)).
        """
        self.finish_grad_sync()
        if self.stage == 0:
            params = [p for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=None)
            if max_norm > 0:  # takes the parameters (it scales their .grad), not the gradients
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            return norm.item()
        local = torch.zeros(1, dtype=torch.float32, device=self.buckets[0].grad_shard.device)
        for bucket in self.buckets:
            shard = bucket.grad_shard.float()
            local += torch.dot(shard, shard)
        norm = self.comm.all_reduce(local, op="sum").sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for bucket in self.buckets:
                bucket.grad_shard.mul_(coef)
        return norm.item()

    @torch.no_grad()
    def step(self) -> None:
        """Finish the gradient reduction, update this rank's shard, and (stages 1-2) all-gather the parameters."""
        self.finish_grad_sync()
        self.optimizer.step()
        if self.stage in (1, 2):
            handles = [self.comm.all_gather(self._master_shard(b).clone(), out=b.param_flat, async_op=True)
                       for b in self.buckets]
            for handle in handles:
                handle.wait()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients now (the next forward would anyway). The shards' buffers are zeroed, not dropped."""
        self.grads.finish_grad_sync()
        self.grads._reset()
        if self.stage == 0:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    # -- checkpoints ----------------------------------------------------------------------------------------------

    def _layout(self) -> dict:
        return {"stage": self.stage, "world": self.comm.size, "rank": self.comm.rank,
                "buckets": [list(b.names) for b in self.buckets]}

    def state_dict(self) -> dict:
        """This rank's part: the optimizer state of its shard and (stage 3) its parameter shards."""
        state = {"layout": self._layout(), "optimizer": self.optimizer.state_dict()}
        if self.stage == 3:
            state["param_shards"] = [b.param_shard.clone() for b in self.buckets]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` of the same rank, stage and group size returned."""
        if state.get("layout") != self._layout():
            raise ValueError(f"this ZeRO state was saved with layout {_describe(state.get('layout'))}, but this "
                             f"rank has {_describe(self._layout())}; resume with the same stage, dp and model")
        self.optimizer.load_state_dict(state["optimizer"])
        if self.stage == 3:
            with torch.no_grad():
                for bucket, shard in zip(self.buckets, state["param_shards"]):
                    bucket.param_shard.copy_(shard)

    # -- whole-model views (collective: every rank of the group must call them) -----------------------------------

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The averaged gradient of every parameter by name, assembled from the shards (before or after clipping)."""
        self.finish_grad_sync()
        if self.stage == 0:
            return {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        return self._gather_by_name(lambda b: b.grad_shard)

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value by name, in `model.named_parameters()` order (stage 3: from the shards)."""
        if self.stage != 3:
            return {n: p.detach().clone() for n, p in self.model.named_parameters()}
        gathered = self._gather_by_name(lambda b: b.param_shard)
        return {n: gathered[n] if n in gathered else p.detach().clone() for n, p in self.model.named_parameters()}

    def _gather_by_name(self, shard_of) -> dict[str, torch.Tensor]:
        out = {}
        for bucket in self.buckets:
            full = self.comm.all_gather(shard_of(bucket))
            out.update({n: v.clone() for n, v in zip(bucket.names, bucket.views(full))})
        return out

    # -- memory ---------------------------------------------------------------------------------------------------

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the model states this rank holds right now: parameters, gradients, optimizer state.

        Counted from the storages the model and this object reference (a view is not counted twice). On a CPU this
        is the honest measure: the process's resident memory also holds the interpreter, torch's libraries and
        freed-but-cached pages, and has no per-tensor accounting like torch.cuda.memory_allocated.
        """
        params = [p.data for p in self.model.parameters()]
        grads = [p.grad for p in self.model.parameters()]
        for b in self.buckets:
            params += [getattr(b, "param_flat", None), getattr(b, "param_shard", None), getattr(b, "full", None)]
            grads += [b.grad, getattr(b, "grad_shard", None)]
        optimizer = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {"params": storage_bytes(params), "grads": storage_bytes(grads), "optimizer": storage_bytes(optimizer)}

    def peak_transient_bytes(self) -> dict[str, int]:
        """Peak bytes of the short-lived buffers (the "temporary buffers" of the paper, §3.2): full parameters of
        gathered units (stage 3) and full gradient buckets in flight (stages 2-3)."""
        return {name: t.peak for name, t in self.transient.items()}


def _unit_buckets(named: list[tuple[str, nn.Parameter]], modules: list[nn.Module | None],
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


def _describe(layout: Any) -> str:
    if not isinstance(layout, dict):
        return repr(layout)
    n = sum(len(b) for b in layout.get("buckets", []))
    return f"stage {layout.get('stage')}, dp {layout.get('world')}, rank {layout.get('rank')}, {n} parameters"


__all__ = ["ZeroOptimizer", "default_units", "storage_bytes", "zero_comm_bytes", "zero_memory_bytes"]
