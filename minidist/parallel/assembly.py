"""One assembly: a built model and a rank grid in, this rank's part of the model and the few operations a training
loop needs out. The loop never asks which dimensions are on.

`parallelize` applies the dimensions in one order, each a transformation of what the previous step returned:

1. tensor (+ sequence) parallel, chapter 08: swap linears and embeddings for sharded ones. Its collectives run
   inside every layer, several per layer, so tp is the innermost dimension of the rank grid (neighbouring ranks,
   the fastest links). The logits become this rank's vocabulary slice, scored by a vocab-parallel cross-entropy.
2. context parallel, chapter 10: swap every attention core for one that attends across the cp ranks, and shard
   each micro-batch's sequence (with its global positions) at the start of a step. It adds no parameters and
   changes only what one forward computes, so it sits with TP among the transformations of the model itself,
   before PP cuts that model into stages (every stage's attention is then context-parallel).
3. expert parallel, chapter 11: swap every MoE layer's experts for this rank's block of them, with all-to-alls
   that carry tokens to their experts and back (over the ep group, ranks borrowed from dp_cp). A transformation
   of the model's modules like TP (which leaves MoE layers whole), so before PP cuts the model into stages.
4. pipeline parallel, chapter 09: keep this rank's blocks (a `StageModule`) and an executor of the schedule.
   After TP, CP and EP, because a stage keeps the (already transformed) modules it owns.
5. data parallel and ZeRO, chapter 07: average gradients over the replicas (the dp_cp group: cp ranks hold the
   same parameters and partial gradients over their own tokens) and shard optimizer state, gradients and
   parameters. Last, because it buckets and shards whatever parameters this rank holds. With EP, expert weights
   are reduced (and sharded) over edp instead: Σ_edp / (dp·cp) (`minidist.parallel.ep.expert_grads`).

Loss normalization is global (the parity law): the loss of a step is Σ token losses / (number of counted target
tokens in the whole global batch), whatever the layout, the micro-batches or the ignored targets. Each rank
back-propagates Σ_its tokens ℓ · R / C, with C the global count and R the number of data-parallel replicas
(the gradient reduction averages over them), so the averaged gradient is exactly ∇ Σ ℓ / C.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from minidist.comm.topology import ParallelDims, Topology
from minidist.model import ModelConfig, lm_loss
from minidist.model.documents import Docs, document_positions
from minidist.model.moe import stats as moe_routing
from minidist.parallel.dp.data_parallel import DataParallel
from minidist.parallel.dp.zero import ZeroOptimizer
from minidist.parallel.ep.expert import apply_expert_parallel, is_expert_param, validate_expert_parallel
from minidist.parallel.ep.expert_grads import ExpertReplicas
from minidist.parallel.grad_sync import GradSync, OwnedRange, SingleReplica
from minidist.parallel.layout import ParallelOptions
from minidist.parallel.placement import Placement, clip_grad_norm_, placement_of
from minidist.parallel.pp.tied import TiedGrads, tie_across_stages
from minidist.parallel.skip_step import skip_unless
from minidist.precision import check_fp32

IGNORE_INDEX = -100  # targets equal to this are not counted (padding, masked prompts): torch's convention
Batches = list[tuple[torch.Tensor, torch.Tensor]]
Autocast = Callable[[], contextlib.AbstractContextManager]


@dataclass
class StepLosses:
    """A step's losses: 0-d float64 tensors on the compute device from `forward_backward_on_device` (no host read),
    Python floats from `forward_backward` and `read()`."""

    loss: torch.Tensor | float  # the global batch's mean LM loss (Σ token losses / global count), the same everywhere
    aux_loss: torch.Tensor | float = 0.0  # MoE balancing losses, mean over micro-batches and replicas

    def read(self) -> StepLosses:
        """The same figures as floats: a host read, which waits for the device."""
        return StepLosses(float(self.loss), float(self.aux_loss))


def count_targets(batches: Batches) -> torch.Tensor:
    """Counted (non-ignored) target tokens in these micro-batches, as a 0-d float64 tensor on their device."""
    return sum((targets != IGNORE_INDEX).sum() for _, targets in batches).double()


def parallelize(model: nn.Module, mcfg: ModelConfig, topo: Topology, options: ParallelOptions,
                make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
                materialize: Callable[[nn.Module], nn.Module] | None = None) -> ParallelModel:
    """This rank's part of a full model built from (seed, names), wrapped with its optimizer; see the module doc.

    With `materialize` (`minidist.parallel.materialize.materializer`), `model` is on the meta device: steps 1-4
    transform its structure, then `materialize` allocates and fills only the parameters this rank kept, before step
    5."""
    loss_fn: Callable = functools.partial(lm_loss, reduction="sum")
    if options.loss_chunk > 0:  # the head moves into a loss that never holds all the logits (tp: vocab-parallel)
        from minidist.model.chunked_loss import apply_chunked_loss

        loss_fn = apply_chunked_loss(model, options.loss_chunk)
    if topo.size("tp") > 1:  # 1. tensor parallel
        from minidist.parallel.tp.tensor import apply_tensor_parallel
        from minidist.parallel.tp.vocab import vocab_parallel_cross_entropy

        tp_comm = topo.comm("tp")
        model = apply_tensor_parallel(model, mcfg, tp_comm, sequence_parallel=options.sequence_parallel,
                                      reduce_dtype=torch.float32 if options.tp_reduce_fp32 else None)
        loss_fn = functools.partial(vocab_parallel_cross_entropy, comm=tp_comm, reduction="sum")
    context = None
    if topo.size("cp") > 1:  # 2. context parallel
        from minidist.parallel.cp import apply_context_parallel, validate_context_parallel

        validate_context_parallel(mcfg, topo.size("cp"), options.cp_impl, tp=topo.size("tp"))
        context = apply_context_parallel(model, topo.comm("cp"), options.cp_impl)
    if topo.size("ep") > 1:  # 3. expert parallel
        validate_expert_parallel(mcfg, topo.size("ep"), topo.size("dp_cp"))
        model = apply_expert_parallel(model, topo.comm("ep"))
    runner = None
    materialize = materialize or (lambda built: built)
    if topo.size("pp") > 1:  # 4. pipeline parallel
        model, runner = _apply_pipeline(model, mcfg, topo, options, loss_fn, materialize)
    else:
        model = materialize(model)
    _record_placement(model, topo)
    tied = tie_across_stages(model, topo) if topo.size("pp") > 1 else None  # before ZeRO lays out the buckets
    optimizer, grad_sync = make_optimizer(model), None
    if topo.size("ep") > 1:  # 5. data parallel in two groups: dense over dp_cp, experts over edp (ZeRO in each)
        grad_sync = ExpertReplicas(model, optimizer, topo, stage=options.zero, bucket_bytes=options.bucket_bytes)
        optimizer = grad_sync if options.zero > 0 else optimizer
    elif options.zero > 0:  # 5. data parallel with ZeRO: the optimizer shards its state (and gradients, parameters)
        optimizer = grad_sync = ZeroOptimizer(model, optimizer, topo.comm("dp_cp"), stage=options.zero,
                                              bucket_bytes=options.bucket_bytes)
    elif topo.size("dp_cp") > 1:  # 5. plain data parallel: averaged gradients, the unsharded optimizer
        grad_sync = DataParallel(model, topo.comm("dp_cp"), bucket_bytes=options.bucket_bytes)
    return ParallelModel(model, optimizer, topo, loss_fn, runner, with_aux=mcfg.moe.n_experts > 0,
                         grad_sync=grad_sync, context=context, tied=tied)


def _apply_pipeline(model: nn.Module, mcfg: ModelConfig, topo: Topology, options: ParallelOptions,
                    loss_fn: Callable, materialize: Callable[[nn.Module], nn.Module]) -> tuple[nn.Module, object]:
    from minidist.parallel.pp.pipeline import PipelineRunner, partition_model

    stage = partition_model(model, topo.coord("pp"), topo.size("pp"), options.virtual_stages, loss_fn=loss_fn,
                            schedule=options.schedule)
    stage = materialize(stage)  # only this stage's blocks (embedding, head) get storage; the runner needs it
    shape = None
    if options.sequence_parallel:  # between stages travels this tp rank's slice of the sequence
        tp, d_model = topo.size("tp"), mcfg.d_model
        shape = lambda tokens: (tokens.shape[0], tokens.shape[1] // tp, d_model)  # noqa: E731
    runner = PipelineRunner(stage, topo.comm("pp"), options.schedule, options.microbatches, options.virtual_stages,
                            activation_shape=shape, with_aux=mcfg.moe.n_experts > 0)
    return stage, runner


def _record_placement(model: nn.Module, topo: Topology) -> None:
    """Complete every parameter's placement: its pipeline stage and the replica groups that hold the same values
    (dp_cp; edp for a block of experts)."""
    for param in model.parameters():
        group = "edp" if is_expert_param(param) else "dp_cp"
        param.placement = dataclasses.replace(placement_of(param), stage=topo.coord("pp"),
                                              replicated_over=(group,) if topo.size(group) > 1 else ())


class ParallelModel:
    """This rank's model and optimizer, with the operations of a training step. The same calls for every layout."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology | None = None,
                 loss_fn: Callable | None = None, runner: object | None = None, with_aux: bool = False,
                 grad_sync: GradSync | None = None, context: object | None = None,
                 tied: TiedGrads | None = None) -> None:
        """Defaults: one process (no process group) and the plain LM loss; `parallelize` passes the rest.
        `grad_sync` reduces gradients over the replicas (minidist/parallel/grad_sync.py): a DataParallel, or the
        ZeroOptimizer that is also `optimizer`, or with expert parallelism an ExpertReplicas (also `optimizer` under
        ZeRO); None: one replica. `context` (a `ContextParallel`) shards each sequence over cp ranks. `tied` sums a
        tied embedding's gradient over its copies on the first and last pipeline stage."""
        topo = topo if topo is not None else Topology(ParallelDims(), rank=0, world_size=1)
        self.model, self.optimizer, self.topo = model, optimizer, topo
        self._grad_sync = grad_sync if grad_sync is not None else SingleReplica(model)
        self.loss_fn = loss_fn or functools.partial(lm_loss, reduction="sum")  # Σ token losses in fp32
        self.runner = runner  # the pipeline executor, None without pipeline parallelism
        self.with_aux = with_aux
        self.context = context  # context parallel: which tokens of each sequence this rank keeps (None: all)
        self.replicas = topo.comm("dp_cp") if topo.size("dp_cp") > 1 else None
        self.model_groups = {name: topo.comm(name) for name in ("tp", "pp") if topo.size(name) > 1}
        self.tied, self._tied_pending = tied, False

    # -- the step ---------------------------------------------------------------------------------------------------

    def forward_backward(self, batches: Batches, autocast: Autocast = contextlib.nullcontext,
                         docs: Docs = None) -> StepLosses:
        """Accumulate the gradient of the global batch's mean loss over this rank's micro-batches; the losses as
        floats (read on the host: `forward_backward_on_device` leaves them on the device). `docs`: each
        micro-batch's document ids (attention within documents, positions restarting at each)."""
        return self.forward_backward_on_device(batches, autocast, docs).read()

    def forward_backward_on_device(self, batches: Batches, autocast: Autocast = contextlib.nullcontext,
                                   docs: Docs = None) -> StepLosses:
        """`forward_backward` with the losses left on the compute device (0-d float64 tensors): nothing waits."""
        batches, positions = self._local_tokens(batches, docs)
        self._tied_pending = self.tied is not None
        count = self._global_sum(count_targets(batches))
        replicas = self.replicas.size if self.replicas is not None else 1
        loss_scale = (replicas / count).float()
        no_sync = self._grad_sync.no_sync
        if self.runner is not None:
            totals = self.runner.step(batches, autocast, no_sync=no_sync, loss_scale=loss_scale,
                                      positions=positions, docs=docs).totals
            loss_sum, aux = totals[0], totals[1]
        else:
            loss_sum, aux = self._accumulate(batches, positions, docs, autocast, no_sync, loss_scale)
        # One all-reduce: the loss sum, and the balancing losses (a per-replica mean: their average is the global)
        totals = self._global_sum(torch.stack([loss_sum.double().to(count.device), aux.double().to(count.device)]))
        return StepLosses(totals[0] / count, totals[1] / replicas)

    def _accumulate(self, batches: Batches, positions: list | None, docs: Docs, autocast: Autocast,
                    no_sync: Callable, loss_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward each micro-batch; data parallelism communicates during the last backward only."""
        total = torch.zeros((), dtype=torch.float32, device=batches[0][0].device)
        aux_total = torch.zeros_like(total)
        for i, (inputs, targets) in enumerate(batches):
            with autocast():
                logits = self.model(inputs, positions[i] if positions else None, docs=docs[i] if docs else None)
            loss_sum = self.loss_fn(logits, targets)  # fp32 whatever the autocast dtype
            check_fp32("loss", loss_sum)
            objective = loss_sum * loss_scale
            if self.with_aux:  # balancing losses are per micro-batch means: 1/M each
                aux = self.model.aux_loss().float()
                objective = objective + aux / len(batches)
                aux_total += aux.detach()
            with no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                objective.backward()
            total += loss_sum.detach()
        return total, aux_total / len(batches)

    def grad_pieces(self) -> tuple[list[tuple[torch.Tensor, Placement]], dict]:
        """This rank's gradient pieces and the groups over which they are disjoint (what the norm sums over); a
        tied embedding's copies hold the sum of both stages' gradients (summed once per step)."""
        pieces, groups = self._reduced_pieces()
        if self._tied_pending:
            self.tied.sum_(pieces)
            self._tied_pending = False
        return pieces, groups

    def _reduced_pieces(self) -> tuple[list[tuple[torch.Tensor, Placement]], dict]:
        """The engine's pieces: whole (averaged) gradients, identical on every replica (the sum skips dp_cp), or
        ZeRO's slices, disjoint over dp_cp (blocks of experts: over ep); with the groups the model is split over."""
        self._grad_sync.finish_grad_sync()
        return self._grad_sync.grad_pieces(), {**self._grad_sync.norm_groups(), **self.model_groups}

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip to a global L2 norm of the whole model's gradient (0: measure only); return the norm before, a 0-d
        float64 tensor on the compute device (no host read)."""
        pieces, groups = self.grad_pieces()
        return clip_grad_norm_(pieces, max_norm, groups)

    def step(self, apply: torch.Tensor | None = None) -> None:
        """The optimizer step, then the MoE router biases (from expert loads summed over all replicas). `apply`, a
        bool tensor on the device (the same on every rank): False makes the step a no-op decided on the device,
        optimizer state included (`minidist.parallel.skip_step`), as a found_inf flag does under loss scaling."""
        if self._tied_pending:  # not clipped: the tied gradients still need their sum
            self.grad_pieces()
        with skip_unless(apply, self.optimizers()):
            self.optimizer.step()
        self._grad_sync.zero_grad()  # every .grad dropped (the averaged ones are views of the engine's buckets)
        if self.with_aux:
            reduce = self.replicas.all_reduce if self.replicas is not None else None
            moe_routing.update_router_biases(self.model, reduce_fn=reduce, apply=apply)

    @torch.no_grad()
    def evaluate(self, batches: Batches, autocast: Autocast = contextlib.nullcontext, docs: Docs = None) -> float:
        """Mean LM loss over fixed batches (every replica evaluates the same ones), forwards only."""
        self.model.eval()
        local, positions = self._local_tokens(batches, docs)
        if self.runner is not None:
            loss_sum = torch.as_tensor(self.runner.evaluate(local, autocast, positions, docs), dtype=torch.float64,
                                       device=batches[0][0].device)
        else:
            loss_sum = torch.zeros((), dtype=torch.float64, device=batches[0][0].device)
            for i, (inputs, targets) in enumerate(local):
                with autocast():
                    logits = self.model(inputs, positions[i] if positions else None,
                                        docs=docs[i] if docs else None)
                    loss_sum += self.loss_fn(logits, targets).double()
        if self.context is not None:  # each cp rank scored its own tokens of every sequence
            self.context.comm.all_reduce(loss_sum)
        self.model.train()
        return (loss_sum.cpu() / count_targets(batches).cpu()).item()

    def _local_tokens(self, batches: Batches, docs: Docs = None) -> tuple[Batches, list[torch.Tensor] | None]:
        """This rank's tokens of each micro-batch and their positions (None: all tokens, 0..T−1): global ones, or
        with `docs` the positions within each token's document [B, T_local]. The ids themselves stay whole."""
        positions = [document_positions(ids) for ids in docs] if docs else None
        return (batches, positions) if self.context is None else self.context.shard(batches, positions)

    def _global_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Σ over the data-parallel replicas (each holds different rows of the global batch)."""
        if self.replicas is not None:
            self.replicas.all_reduce(value)
        return value

    # -- state ------------------------------------------------------------------------------------------------------

    def moe_stats(self) -> dict[str, float]:
        """The step's MoE balance figures over the global batch: sums added over the replicas and the stages
        (collective: every rank calls it). tp ranks route the same tokens, so their sums are not added."""
        return moe_routing.read_figures(self.moe_stats_on_device())

    def moe_stats_on_device(self) -> dict[str, torch.Tensor]:
        """`moe_stats` as 0-d tensors on the compute device (no host read)."""
        if not self.with_aux:
            return {}

        def reduce(sums: torch.Tensor) -> None:
            for comm in (self.replicas, self.model_groups.get("pp")):
                if comm is not None:
                    comm.all_reduce(sums)
        return moe_routing.moe_stats_on_device(self.model, reduce)

    def finish_grad_sync(self) -> None:
        """Wait for this step's gradient reduction: every replica then holds the reduced gradients (or shards)."""
        self._grad_sync.finish_grad_sync()

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """This rank's reduced gradients by name (a tensor-parallel slice or a block of experts stays this rank's),
        assembled from ZeRO's shards (collective then: every rank of the replica groups calls it)."""
        return self._grad_sync.full_gradients()

    def full_parameters(self) -> Iterator[torch.Tensor]:
        """This rank's parameters in model order, whole under ZeRO-3: gathered one unit at a time as the caller
        iterates, so a hash never holds the whole model (collective: every rank iterates to the end)."""
        return (value for _, value in self._grad_sync.iter_full_parameters())

    # -- what this rank holds: checkpoints, memory accounting, replica checks --------------------------------------

    @property
    def params_sharded(self) -> bool:
        """Whether the parameters live as disjoint slices over their replicas (ZeRO-3): no replica holds them whole,
        and the model's parameters are empty between gathers (`param_pieces()` holds the slices)."""
        return self._grad_sync.params_sharded

    def param_pieces(self) -> dict[str, torch.Tensor]:
        """The part of each parameter this rank updates, by name: ZeRO's slices of the parameter shards (views; empty
        for a parameter outside this rank's slices), else the whole (local) parameters."""
        return self._grad_sync.param_pieces()

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers that hold this rank's optimizer state: the one `parallelize` was given, or those
        ZeRO built over this rank's shards in its place."""
        return self._grad_sync.optimizers() or [self.optimizer]

    def owned_ranges(self) -> list[OwnedRange]:
        """Every parameter's elements whose optimizer state this rank holds, and which optimizer holds it: each
        parameter whole (the given optimizer's), then ZeRO's ranges of the parameters it shards (disjoint over
        their `sharded_over` group; a parameter outside this rank's slices has none). A parameter whole with
        optimizer None is one no optimizer updates."""
        engine_optimizers = self._grad_sync.optimizers()
        sharded = {name for name, _ in self._grad_sync.named} if engine_optimizers else set()
        whole = None if engine_optimizers else self.optimizer
        return [*(OwnedRange(name, 0, p.numel(), p, whole, placement_of(p), tuple(p.shape))
                  for name, p in self.model.named_parameters() if name not in sharded),
                *self._grad_sync.owned_ranges()]

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors of the model states this rank holds: "params" (the parameters; ZeRO's flat buffers and
        shards) and "grads" (`.grad`; the reduction's buckets and gradient shards). Views of one storage repeat:
        count storages (`minidist.memory.storage_bytes`). Optimizer state: `optimizers()`."""
        params = list(self.model.parameters())
        held = self._grad_sync.held_tensors()
        return {"params": [p.data for p in params] + held["params"],
                "grads": [p.grad for p in params if p.grad is not None] + held["grads"]}

    def reduction_bytes(self, op: str | None = None) -> int:
        """Bytes this rank's gradient reduction sent so far by collective `op` (None: all), from its groups'
        ledgers (0 with one replica)."""
        return sum(comm.ledger.bytes(op, comm.name) for comm in self._grad_sync.comms())
