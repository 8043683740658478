"""ZeRO: data parallelism that stops replicating the model states (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models").

Plain data parallelism keeps on every rank the parameters, the gradients and the optimizer state of the whole model:
(P + G + K)·Ψ bytes for Ψ parameters (P, G bytes per parameter and gradient, K bytes of optimizer state). ZeRO
partitions them over the N_d ranks of the data-parallel group, in three stages (§5, Figure 1):

    stage 1 (P_os)       optimizer state sharded          P·Ψ + G·Ψ + K·Ψ/N_d
    stage 2 (P_os+g)     + gradients reduce-scattered     P·Ψ + (G + K)·Ψ/N_d
    stage 3 (P_os+g+p)   + parameters sharded             (P + G + K)·Ψ/N_d

The paper's mixed-precision figures are P = G = 2 (fp16) and K = 12 (fp32 master weights, momentum, variance).
Our fp32 training needs no master copy: P = G = 4, K = 8. The formulas are in zero_bytes.py.

How each stage is built here, on flat buffers (several parameters side by side, padded so N_d divides them; rank r
owns the r-th equal slice of each), from three parts:

- the gradient reduction, a strategy plugged into `DataParallel` (its hooks, bucket order and overlap): stage 0
  all-reduces; stage 1 reduce-scatters the full buckets once per step; stages 2-3 reduce-scatter every micro-batch
  into a persistent shard, a bucket's full buffer living only while in flight (zero_grads.py);
- where the parameters live: whole in the model (stage 0), as views of flat buffers whose slice this rank updates and
  then all-gathers (stages 1-2), or as shards gathered unit by unit just in time (stage 3) (zero_params.py);
- the optimizer: the caller's own (e.g. torch.optim.AdamW), rebuilt over *pieces*: the slices of this rank's shard
  that belong to each parameter, in the same param groups. AdamW is elementwise, so updating the pieces is exactly
  the update the full optimizer would make (bit for bit); an optimizer that is not (Adafactor) is refused.

Bytes per step: reduce-scatter + all-gather = one all-reduce, as in plain data parallelism (stages 1-2, §7.2.1);
stage 3 gathers the parameters twice per micro-batch: 1.5x (§7.2.2).

Global-norm clipping uses the package's one gradient norm (`placement.clip_grad_norm_`): `grad_pieces()` are this
rank's slices of the averaged gradient, disjoint over the dp_cp group, so their squares are summed over it
(`norm_groups()`); a caller adds the groups its model is split over (tp, pp). At stage 0 every rank holds the
same whole gradient: nothing to sum over dp_cp.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from minidist.comm.communicator import Comm
from minidist.memory import PeakBytes, storage_bytes
from minidist.parallel.dp.data_parallel import (
    AllReduceGrads,
    DataParallel,
    GradReduction,
    assign_buckets,
    default_bucket_bytes,
)
from minidist.parallel.dp.timeline import Timeline
from minidist.parallel.dp.zero_grads import ReduceScatterEveryMicrobatch, ReduceScatterOnce
from minidist.parallel.dp.zero_params import FlatParams, ParamHome, ShardedParams, default_units, unit_buckets
from minidist.parallel.grad_sync import GradSync, OwnedRange
from minidist.parallel.placement import GradPiece, clip_grad_norm_, placement_of
from minidist.parallel.pp.tied import is_tied
from minidist.precision import FP32_COMM, CommPrecision

# Optimizers whose update of an element reads only that element's gradient and state (and the step count), so that
# updating slices of a parameter is exactly updating it whole (tests/test_zero.py checks each). Not: Adafactor
# (second moments factored over a matrix's rows and columns), Muon (orthogonalizes whole matrices), LBFGS.
ELEMENTWISE_OPTIMIZERS = (torch.optim.Adadelta, torch.optim.Adagrad, torch.optim.Adam, torch.optim.Adamax,
                          torch.optim.AdamW, torch.optim.ASGD, torch.optim.NAdam, torch.optim.RAdam,
                          torch.optim.RMSprop, torch.optim.Rprop, torch.optim.SGD)


class ZeroOptimizer(GradSync):
    """Data parallelism at ZeRO `stage` (0-3) over `comm`: gradient reduction, a sharded optimizer, clipping.

    `optimizer` is the unsharded optimizer you would use on one device (e.g. AdamW over param groups); it serves as
    a template: its class, hyperparameters and param groups are rebuilt over this rank's shard (stage 0 uses it as
    it is: `DataParallel` plus the unsharded optimizer). It must not have taken a step yet. Use it where a torch
    optimizer goes:

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

    `params` (default: all the model's) are the (name, parameter) pairs this object shards over `comm`, and the sum
    of their gradients over the group is divided by `grad_divisor` (default: the group size, the average): expert
    parallelism shards the expert weights over edp and divides by dp·cp (minidist/parallel/ep/expert_grads.py).
    It is a `GradSync` (minidist/parallel/grad_sync.py): what `ParallelModel` calls.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, comm: Comm, stage: int = 1, *,
                 bucket_bytes: int | None = None, units: Sequence[nn.Module] | None = None,
                 overlap: bool = True, prefetch: bool = True, timeline: Timeline | None = None,
                 params: Sequence[tuple[str, nn.Parameter]] | None = None, grad_divisor: int | None = None,
                 comm_precision: CommPrecision = FP32_COMM) -> None:
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
        if stage > 0 and type(optimizer) not in ELEMENTWISE_OPTIMIZERS:
            names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
            raise ValueError(f"ZeRO stage {stage} shards each parameter's optimizer state by elements, which is exact "
                             f"only for elementwise optimizers ({names}); {type(optimizer).__name__} is not: use "
                             "stage 0")
        # Adagrad fills its state at construction, with step 0: only a step taken would be lost.
        if any(float(state.get("step", 1)) > 0 for state in optimizer.state.values() if state):
            raise ValueError("the template optimizer has already taken a step; build ZeroOptimizer before the first")
        self.model, self.comm, self.stage, self.grad_divisor = model, comm, stage, grad_divisor
        self.comm_precision = comm_precision
        self.transient = {"gathered_params": PeakBytes(), "grad_buckets": PeakBytes()}
        named = [(n, p) for n, p in (params if params is not None else model.named_parameters()) if p.requires_grad]
        self.named = named
        self.placements = {id(p): placement_of(p) for _, p in named}  # before ZeRO-3 empties the parameters
        if stage == 3:  # one bucket per gather unit, in backward order: the blocks last to first, then the root
            modules = [*reversed(list(units if units is not None else default_units(model))), None]
            self.buckets, modules = unit_buckets(named, modules, comm.size)
            self.params: ParamHome = ShardedParams(model, comm, self.buckets, modules,
                                                   self.transient["gathered_params"], prefetch,
                                                   comm_precision.gather_dtype)
        else:
            # a tied embedding's copies (first and last pipeline stage) need the same flat layout: a bucket alone
            if bucket_bytes is None:
                bucket_bytes = default_bucket_bytes(named[0][1].device if named else torch.device("cpu"))
            self.buckets = assign_buckets(named, bucket_bytes, pad_to=comm.size, alone=is_tied)
            self.params = FlatParams(self.buckets, comm) if stage > 0 else ParamHome()
        self.grads = DataParallel(model, comm, overlap=overlap, timeline=timeline, buckets=self.buckets,
                                  reduction=self._reduction(), params=named)
        self.optimizer = optimizer if stage == 0 else self._shard_optimizer(optimizer)

    # -- construction ---------------------------------------------------------------------------------------------

    def _reduction(self) -> GradReduction:
        reduce_dtype = self.comm_precision.reduce_dtype
        if self.stage == 0:
            return AllReduceGrads(self.comm, reduce_dtype, divisor=self.grad_divisor)
        if self.stage == 1:
            return ReduceScatterOnce(self.comm, reduce_dtype, divisor=self.grad_divisor)
        return ReduceScatterEveryMicrobatch(self.comm, self.transient["grad_buckets"], reduce_dtype,
                                            after_launch=self.params.release, divisor=self.grad_divisor)

    def _owned_slices(self) -> Iterator[tuple[nn.Parameter, int, torch.Tensor, torch.Tensor]]:
        """(parameter, the first of its flattened elements in this rank's slice, its slice of this rank's parameter
        shard, the same slice of the gradient shard), for every parameter that overlaps this rank's slice of its
        bucket. Views: updating them updates the shards."""
        for bucket in self.buckets:
            start, stop = bucket.shard_range(self.comm.rank, self.comm.size)
            for param, offset, n in zip(bucket.params, bucket.offsets, bucket.numels):
                lo, hi = max(offset, start) - start, min(offset + n, stop) - start
                if lo < hi:
                    yield param, lo + start - offset, bucket.param_shard[lo:hi], bucket.grad_shard[lo:hi]

    def _shard_optimizer(self, template: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The template's optimizer class and param groups, over this rank's slices of each parameter."""
        group_of = {id(p): i for i, g in enumerate(template.param_groups) for p in g["params"]}
        missing = [b.names[i] for b in self.buckets for i, p in enumerate(b.params) if id(p) not in group_of]
        if missing:
            raise ValueError(f"parameter {missing[0]} requires grad but is not in the optimizer")
        pieces: list[list[torch.Tensor]] = [[] for _ in template.param_groups]
        for param, _, piece, grad in self._owned_slices():
            piece.grad = grad
            pieces[group_of[id(param)]].append(piece)
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

    def grad_pieces(self) -> list[GradPiece]:
        """This rank's averaged gradient as (tensor, placement) pieces for `placement.grad_norm`, after
        `finish_grad_sync()`: each parameter's slice of the gradient shards (views, so scaling them in place scales
        what the optimizer step reads); at stage 0, each parameter's whole `.grad`."""
        if self.stage == 0:
            return [(p.grad, self.placements[id(p)]) for b in self.buckets for p in b.params if p.grad is not None]
        return [(grad, self.placements[id(param)]) for param, _, _, grad in self._owned_slices()]

    def owned_ranges(self) -> list[OwnedRange]:
        """The parameter ranges this rank updates: elements [start, stop) of each parameter's flattened (local)
        tensor, keyed in the optimizer's state by the view of the shard (stage 0: the parameter, whole). What a
        checkpoint another layout can read is built from (`minidist.train.reshard`)."""
        shapes = {id(p): tuple(s) for b in self.buckets for p, s in zip(b.params, b.shapes)}  # before ZeRO-3 empties
        if self.stage == 0:
            return [OwnedRange(n, 0, p.numel(), p, self.optimizer, self.placements[id(p)], shapes[id(p)])
                    for n, p in self.named]
        # the optimizer holds the views an earlier _owned_slices made: each found by its address
        keys = {piece.data_ptr(): piece for g in self.optimizer.param_groups for piece in g["params"]}
        names = {id(p): n for n, p in self.named}
        return [OwnedRange(names[id(param)], first, first + piece.numel(), keys[piece.data_ptr()], self.optimizer,
                           self.placements[id(param)], shapes[id(param)], self.comm.name)
                for param, first, piece, _ in self._owned_slices()]

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    def comms(self) -> list[Comm]:
        return [self.comm]

    def norm_groups(self) -> dict[str, Comm]:
        """The groups over which `grad_pieces()` are disjoint: dp_cp when sharded; none when every rank holds the
        same reduced gradient (stage 0)."""
        return {"dp_cp": self.comm} if self.stage > 0 else {}

    def clip_grad_norm(self, max_norm: float, extra_groups: dict[str, Comm] | None = None) -> float:
        """Finish the gradient sync, then scale the gradients to a global L2 norm of at most `max_norm` (0: measure
        only); return the norm before clipping (read on the host; the trainer's `ParallelModel` keeps it on the
        device). `extra_groups` are the other groups the model is split over (e.g. {"tp": ..., "pp": ...}): the norm
        is then the whole model's."""
        self.finish_grad_sync()
        return float(clip_grad_norm_(self.grad_pieces(), max_norm, {**self.norm_groups(), **(extra_groups or {})}))

    @torch.no_grad()
    def step(self) -> None:
        """Finish the gradient reduction, update this rank's shard, and bring every rank the updated parameters."""
        self.finish_grad_sync()
        self.optimizer.step()
        self.params.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients now (the next forward would anyway). The buffers are zeroed, never dropped, whatever
        `set_to_none` (accepted for torch.optim's signature)."""
        self.grads.zero_grad()

    # -- checkpoints ----------------------------------------------------------------------------------------------

    def _layout(self) -> dict:
        return {"stage": self.stage, "world": self.comm.size, "rank": self.comm.rank,
                "buckets": [list(b.names) for b in self.buckets]}

    def state_dict(self) -> dict:
        """This rank's part: the optimizer state of its shard and (stage 3) its parameter shards."""
        return {"layout": self._layout(), "optimizer": self.optimizer.state_dict(), **self.params.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` of the same rank, stage and group size returned."""
        if state.get("layout") != self._layout():
            raise ValueError(f"this ZeRO state was saved with layout {_describe(state.get('layout'))}, but this "
                             f"rank has {_describe(self._layout())}; resume with the same stage, dp and model")
        self.optimizer.load_state_dict(state["optimizer"])
        self.params.load_state_dict(state)

    # -- whole-model views (collective: every rank of the group must call them) -----------------------------------

    @torch.no_grad()
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The averaged gradient of every parameter by name, assembled from the shards (before or after clipping)."""
        self.finish_grad_sync()
        if self.stage == 0:
            return {n: p.grad.detach().clone() for n, p in self.named if p.grad is not None}
        out = {}
        for bucket in self.buckets:
            full = self.comm.all_gather(bucket.grad_shard)
            out.update({n: v.clone() for n, v in zip(bucket.names, bucket.views(full))})
        return out

    @torch.no_grad()
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's full value by name, in `model.named_parameters()` order (stage 3: from the shards)."""
        return {name: value.clone() for name, value in self.iter_full_parameters()}

    @torch.no_grad()
    def iter_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full value) in `model.named_parameters()` order, one at a time: stage 3 gathers one unit at a
        time, so a caller that consumes them one by one (a hash, a file) never holds the whole model. Collective
        at stage 3: every rank of the group iterates to the end."""
        return self.params.iter_full(self.named)

    def param_pieces(self) -> dict[str, torch.Tensor]:
        """The part of each parameter this rank updates, by name: its slice of the parameter shards (views; empty
        for a parameter outside this rank's slices) at stages 1-3, the whole parameter at stage 0."""
        if self.stage == 0:
            return {n: p.detach() for n, p in self.named}
        names = {id(p): n for n, p in self.named}
        pieces = {n: p.new_empty(0) for n, p in self.named}
        pieces.update({names[id(param)]: piece for param, _, piece, _ in self._owned_slices()})
        return pieces

    # -- memory ---------------------------------------------------------------------------------------------------

    @property
    def params_sharded(self) -> bool:
        return self.stage == 3

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The flat parameter buffers and shards, and the gradient buckets and shards (stage 0: the buckets)."""
        return {"params": self.params.buffers(), "grads": self.grads.held_tensors()["grads"]}

    def memory_bytes(self) -> dict[str, int]:
        """Bytes of the model states this rank holds right now: parameters, gradients, optimizer state.

        Counted from the storages the model and this object reference (a view is not counted twice). On a CPU this
        is the honest measure: the process's resident memory also holds the interpreter, torch's libraries and
        freed-but-cached pages, and has no per-tensor accounting like torch.cuda.memory_allocated.
        """
        held = self.held_tensors()
        params = [p.data for _, p in self.named] + held["params"]
        grads = [p.grad for _, p in self.named] + held["grads"]
        optimizer = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return {"params": storage_bytes(params), "grads": storage_bytes(grads), "optimizer": storage_bytes(optimizer)}

    def peak_transient_bytes(self) -> dict[str, int]:
        """Peak bytes of the short-lived buffers (the "temporary buffers" of the paper, §3.2): full parameters of
        gathered units (stage 3) and full gradient buckets in flight (stages 2-3)."""
        return {name: t.peak for name, t in self.transient.items()}


def _describe(layout: Any) -> str:
    if not isinstance(layout, dict):
        return repr(layout)
    n = sum(len(b) for b in layout.get("buckets", []))
    return f"stage {layout.get('stage')}, dp {layout.get('world')}, rank {layout.get('rank')}, {n} parameters"

