"""The trainer: `python -m minidist.train` on one process, `torchrun --nproc_per_node=N -m minidist.train` on N.

Read it top to bottom; each part is one short function:

1. Configuration lives in `minidist.train_config`: `TrainConfig`, read from defaults < a TOML file < flags
   (`parse_config`), checked by `check_config` (bad values are one-line `ConfigError`s; exit code 2).
2. The rank grid: `DistEnv` (what torchrun says about this process), `resolve_parallel_dims` (checked against the
   world size before any process group exists), `init_distributed` (world size 1 creates no process group).
3. The model and the step: `build_parallel_model` (build the full model, then `parallelize` it for the layout),
   `forward_backward` (gradient accumulation over micro-batches), `clip_grad_norm`, `train_step`, `evaluate`.
4. The loop: `train(cfg)` sets up a `Run` (`setup`), restores it (`restore`) and runs `train_loop`, which logs
   `OUT/metrics.jsonl`, evaluates, checkpoints and finally plots `OUT/loss.png`.

Outputs in OUT/: `run.json` (resolved settings, corpus, parameter counts, unigram entropy, FLOPs per token, the
peak FLOP/s used for MFU and its source; final figures added at the end), `metrics.jsonl` (one object per optimizer
step: `step` is the 0-based step index, `loss` the mean LM loss of its global batch before the update, `lr`,
`grad_norm` before clipping, `tokens_per_s`, `mfu`, `step_s`; `val_loss` after the update on evaluation steps;
`aux_loss` and `moe_*` for MoE models), `loss.png`, and `checkpoints/` (see minidist.checkpoint).

Where the parallel chapters plug in: `resolve_parallel_dims` (drop the "not available yet" error of a dimension;
`check_model_split` checks the model against tp and pp), `parallelize` (swap modules, keep this rank's pipeline
stage), `data_parallel` (gradient reduction, ZeRO), `local_batches` (which rows and which positions this rank sees),
`global_mean` (the logged loss over replicas), `clip_sharded_grad_norm` (a norm over tp shards and pp stages) and
`train_step` (a `PipelineRunner` replaces `forward_backward`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from minidist import checkpoint, flops, health
from minidist.corpus import BatchSampler, Corpus, load_corpus, unigram_entropy_nats
from minidist.model import ModelConfig, build_model, lm_loss
from minidist.optim import WarmupCosine, build_optimizer
from minidist.plots import plot_losses, read_metrics
from minidist.topology import ParallelDims, Topology
from minidist.train_config import (  # noqa: F401  (re-exported: tests and users import them from here)
    FLAGS,
    ConfigError,
    TrainConfig,
    build_parser,
    check_config,
    config_from_values,
    config_to_values,
    lr_schedule,
    model_config,
    parse_config,
    read_toml,
)

# ================================================================================================================
# 2. The rank grid
# ================================================================================================================


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job: from an initialised process group, else from torchrun's variables."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def detect(cls) -> DistEnv:
        env = os.environ
        if dist.is_available() and dist.is_initialized():  # e.g. minidist.launch.run_ranks
            rank = dist.get_rank()
            return cls(rank, dist.get_world_size(), int(env.get("LOCAL_RANK", rank)))
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


# What each dimension needs and the chapter that brings it. A chapter deletes its line when it lands.
NOT_AVAILABLE_YET = {
    "cp": ("context parallelism", "10"),
    "ep": ("expert parallelism", "11"),
}


def resolve_parallel_dims(cfg: TrainConfig, world_size: int) -> ParallelDims:
    """The layout of this run, checked against the world size. Called before any process group is created."""
    rest = cfg.tp * cfg.pp * cfg.cp
    dp = cfg.dp if cfg.dp is not None else max(1, world_size // rest)
    try:
        dims = ParallelDims(dp=dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep)
        dims.validate(world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for name, (what, chapter) in NOT_AVAILABLE_YET.items():
        if getattr(dims, name) > 1:
            raise ConfigError(f"--{name} {getattr(dims, name)}: {what} is not available yet (chapter {chapter})")
    if cfg.batch_size % (dims.dp * cfg.microbatches):
        raise ConfigError(f"batch_size {cfg.batch_size} is not divisible by dp*microbatches = "
                          f"{dims.dp}*{cfg.microbatches}; pick a multiple of {dims.dp * cfg.microbatches}")
    check_model_split(cfg, dims)
    return dims


def check_model_split(cfg: TrainConfig, dims: ParallelDims) -> None:
    """Chapters 08-09: can the model be cut over tp ranks and pp stages this way? One-line ConfigError if not."""
    from minidist.parallel.pipeline import validate_pipeline
    from minidist.parallel.tensor import validate_tensor_parallel

    mcfg = model_config(cfg)
    if cfg.sp and dims.tp == 1:
        raise ConfigError("--sp (sequence parallel) splits the sequence over tensor-parallel ranks: it needs --tp > 1")
    if dims.pp == 1 and cfg.virtual_stages > 1:
        raise ConfigError(f"--virtual-stages {cfg.virtual_stages} cuts each pipeline rank's layers into chunks: "
                          "it needs --pp > 1")
    if cfg.zero == 3 and dims.tp * dims.pp > 1:
        raise ConfigError(f"--zero 3 with tp={dims.tp} pp={dims.pp} is not supported yet (ZeRO-3's parameter "
                          "gathering is not wired for tp-sharded or pipeline-stage models); use --zero 1 or 2")
    try:
        validate_tensor_parallel(mcfg, dims.tp, cfg.seq_len, cfg.sp)
        if dims.pp > 1:
            validate_pipeline(mcfg, dims.pp, cfg.microbatches, cfg.virtual_stages, cfg.schedule,
                              batch_size=cfg.batch_size // dims.dp)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def init_distributed(dims: ParallelDims, env: DistEnv, device: torch.device) -> tuple[Topology, bool]:
    """Join the process group (unless world size 1, or already joined) and slice the rank grid into groups.

    Returns the topology and whether this call created the default group (then `train` destroys it at the end).
    """
    created = False
    if env.world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=env.rank,
                                world_size=env.world_size)
        created = True
    return Topology(dims, env.rank, env.world_size), created


def pick_device(cfg: TrainConfig, env: DistEnv) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available; use --device cpu")
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


# ================================================================================================================
# 3. The model and one step
# ================================================================================================================


def build_parallel_model(mcfg: ModelConfig, cfg: TrainConfig, topo: Topology, device: torch.device
                         ) -> tuple[nn.Module, Callable, dict[str, int]]:
    """Every rank builds the full model from (seed, parameter names), then keeps and wraps its part.

    Returns (this rank's model, its loss function, the full model's parameter counts).
    """
    model = build_model(mcfg, seed=cfg.seed).to(device)
    counts = parameter_counts(model)
    model, loss_fn = parallelize(model, mcfg, topo, cfg)
    return model, loss_fn, counts


def parameter_counts(model: nn.Module) -> dict[str, int]:
    params = sum(p.numel() for p in model.parameters())  # a tied weight is counted once
    embedding = sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters())
    return {"params": params, "params_non_embedding": params - embedding}


def parallelize(model: nn.Module, mcfg: ModelConfig, topo: Topology, cfg: TrainConfig) -> tuple[nn.Module, Callable]:
    """Transform a full model for this rank's place in the grid (DESIGN §2); return it and its loss function
    (logits, targets) -> mean loss. World size 1: the model itself and `lm_loss`.

    The chapters add, in this order: tensor + sequence parallel (08: swap linears and embeddings for sharded ones;
    the logits are this rank's vocabulary slice, scored by a vocab-parallel cross-entropy), expert parallel (11:
    keep this rank's experts), pipeline parallel (09: keep this stage's blocks, a `StageModule`), context parallel
    (10: ring attention), data parallel / ZeRO (07: `data_parallel`, applied to the result by `setup`).
    """
    loss_fn: Callable = lm_loss
    if topo.size("tp") > 1:
        from minidist.parallel.tensor import apply_tensor_parallel
        from minidist.parallel.vocab import vocab_parallel_lm_loss

        tp_comm = topo.comm("tp")
        model = apply_tensor_parallel(model, mcfg, tp_comm, sequence_parallel=cfg.sp,
                                      reduce_dtype=torch.float32 if cfg.tp_reduce_fp32 else None)
        loss_fn = functools.partial(vocab_parallel_lm_loss, comm=tp_comm)
    if topo.size("pp") > 1:
        from minidist.parallel.pipeline import partition_model

        model = partition_model(model, topo.coord("pp"), topo.size("pp"), cfg.virtual_stages, loss_fn=loss_fn)
    return model, loss_fn


def pipeline_runner(model: nn.Module, topo: Topology, cfg: TrainConfig, with_aux: bool) -> Any:
    """Chapter 09: the executor of this rank's schedule (None without pipeline parallelism)."""
    if topo.size("pp") == 1:
        return None
    from minidist.parallel.pipeline import PipelineRunner

    shape = None
    if cfg.sp:  # between stages travels this tp rank's slice of the sequence
        tp, d_model = topo.size("tp"), model.cfg.d_model
        shape = lambda tokens: (tokens.shape[0], tokens.shape[1] // tp, d_model)  # noqa: E731
    return PipelineRunner(model, topo.comm("pp"), cfg.schedule, cfg.microbatches, cfg.virtual_stages,
                          activation_shape=shape, with_aux=with_aux)


def local_batches(sampler: BatchSampler, step: int, topo: Topology, microbatches: int,
                  device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of the global batch of `step`, split into micro-batches of (inputs, targets)."""
    inputs, targets = sampler.shard(step, topo.coord("dp"), topo.size("dp"))
    inputs, targets = inputs.to(device), targets.to(device)
    return list(zip(inputs.chunk(microbatches), targets.chunk(microbatches)))


def autocast_for(dtype: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context the forward pass runs in: bf16 autocast, or nothing for fp32."""
    if dtype == "bf16":
        return functools.partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


@dataclass
class StepResult:
    loss: float  # mean LM loss over this rank's micro-batches (fp32)
    grad_norm: float  # global gradient norm before clipping
    aux_loss: float = 0.0  # MoE balancing losses, mean over micro-batches


def forward_backward(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                     autocast: Callable = contextlib.nullcontext, with_aux: bool = False,
                     no_sync: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                     loss_fn: Callable = lm_loss) -> tuple[float, float]:
    """Accumulate the gradient of the mean loss over the micro-batches; return (mean LM loss, mean aux loss).

    Every micro-batch has the same number of tokens, so the mean over the global batch is the mean of the
    micro-batch means: scaling each micro-batch loss by 1/M before backward makes the summed gradients equal the
    full-batch gradient (forgetting the 1/M gives an M-times too large gradient). Data parallelism (chapter 07)
    communicates once per step: the backward passes of all micro-batches but the last run inside `no_sync()`.
    Tensor parallelism (chapter 08) passes a vocab-parallel `loss_fn`: the same loss on every tp rank, and each
    rank's backward gives its own shards' gradients (no division by tp).
    """
    scale = 1.0 / len(batches)
    total = torch.zeros((), dtype=torch.float32, device=batches[0][0].device)
    aux_total = torch.zeros_like(total)
    for i, (inputs, targets) in enumerate(batches):
        with autocast():
            logits = model(inputs)
        loss = loss_fn(logits, targets)  # cross-entropy in fp32, whatever the autocast dtype
        health.check_fp32("loss", loss)
        objective = loss
        if with_aux:
            aux = model.aux_loss().float()
            objective = objective + aux
            aux_total += aux.detach()
        with no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
            (objective * scale).backward()
        total += loss.detach()
    return (total * scale).item(), (aux_total * scale).item()


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> float:
    """Clip the gradients to a global L2 norm of max_norm (0: no clipping); return the norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm.item()


def clip_sharded_grad_norm(model: nn.Module, optimizer: Any, max_norm: float, topo: Topology) -> float:
    """`clip_grad_norm` when the parameters are split over tp ranks and pp stages: the norm of the whole model.

    Squares are summed over this rank's gradients (a tp-replicated parameter counted once, not tp times), then over
    the tp and pp groups; ZeRO (stages 1-2) holds gradient shards, summed over dp_cp too. Every rank gets the same
    norm and scales by the same factor, so replicas stay identical.
    """
    from minidist.parallel.sharded import clip_zero_tp_grad_norm_, sharded_grad_norm

    tp_comm, pp_comm = topo.comm("tp"), topo.comm("pp")
    zero_stage = getattr(optimizer, "stage", 0)
    if hasattr(optimizer, "finish_grad_sync"):
        optimizer.finish_grad_sync()
    if zero_stage == 0:  # full (tp-sharded) gradients on every rank
        params = [p for p in model.parameters() if p.grad is not None]
        pieces = [(p.grad, p.tp_layout.replicas if hasattr(p, "tp_layout") else 1) for p in params]
        norm = sharded_grad_norm(pieces, [c for c in (tp_comm, pp_comm) if c.size > 1])
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm.item()

    def zero_norm(limit: float) -> float:  # the norm over dp_cp (and tp); clips to `limit` unless it is 0
        if tp_comm.size > 1:
            return clip_zero_tp_grad_norm_(optimizer, limit, tp_comm)
        return optimizer.clip_grad_norm(limit)

    if pp_comm.size == 1:
        return zero_norm(max_norm)
    # Bring in the other stages: measure, sum the squares over pp, then clip through ZeRO's own max_norm so that
    # its factor max_norm' / (local + 1e-6) equals the global one, max_norm / (total + 1e-6).
    local = zero_norm(0.0)
    square = torch.tensor([local * local], dtype=torch.float64, device=optimizer.buckets[0].grad_shard.device)
    total = pp_comm.all_reduce(square).sqrt().item()
    coef = max_norm / (total + 1e-6)
    if max_norm > 0 and coef < 1.0:
        zero_norm(coef * (local + 1e-6))
    return total


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]],
               *, step: int, grad_clip: float, autocast: Callable = contextlib.nullcontext,
               with_aux: bool = False, loss_fn: Callable = lm_loss, runner: Any = None,
               topo: Topology | None = None) -> StepResult:
    """One optimizer step on the micro-batches of one global batch. Stops (TrainingDiverged) before a bad update.

    With pipeline parallelism `runner` (a `PipelineRunner`) runs the forwards and backwards in its schedule's
    order; its loss is the last stage's, shared with every stage. `topo` (tp or pp > 1) clips by the whole model's
    norm.
    """
    no_sync = getattr(optimizer, "no_sync", contextlib.nullcontext)
    if runner is not None:
        stats = runner.step(batches, autocast, no_sync=no_sync)
        loss, aux = stats.loss, stats.aux_loss
    else:
        loss, aux = forward_backward(model, batches, autocast, with_aux, no_sync=no_sync, loss_fn=loss_fn)
    if topo is not None and topo.size("tp") * topo.size("pp") > 1:  # chapters 08-09: a norm over split parameters
        grad_norm = clip_sharded_grad_norm(model, optimizer, grad_clip, topo)
    elif hasattr(optimizer, "clip_grad_norm"):  # chapter 07: the norm over every rank's gradient shard
        grad_norm = optimizer.clip_grad_norm(grad_clip)
    else:
        grad_norm = clip_grad_norm(model.parameters(), grad_clip)
    health.check_finite(step, loss, grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(loss, grad_norm, aux)


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
             autocast: Callable = contextlib.nullcontext, loss_fn: Callable = lm_loss, runner: Any = None) -> float:
    """Mean LM loss over fixed validation batches (through the pipeline stages, forwards only, with a runner)."""
    model.eval()
    if runner is not None:
        loss = runner.evaluate(batches, autocast)
        model.train()
        return loss
    total = torch.zeros((), dtype=torch.float32)
    for inputs, targets in batches:
        with autocast():
            logits = model(inputs)
        total += loss_fn(logits, targets).cpu()
    model.train()
    return (total / len(batches)).item()


def global_mean(value: float, topo: Topology) -> float:
    """The mean of a per-replica number over the data-parallel replicas: the logged loss is the global mean.

    With one replica it is the value itself; otherwise an all-reduce over the dp_cp group averages it.
    """
    if topo.size("dp_cp") == 1:
        return value
    device = "cuda" if dist.get_backend(topo.group("dp_cp")) == "nccl" else "cpu"
    mean = torch.tensor([value], dtype=torch.float64, device=device)
    topo.comm("dp_cp").all_reduce(mean, op="avg")
    return mean.item()


# ================================================================================================================
# 4. The run
# ================================================================================================================

VAL_SEED = 20240101  # validation batches do not depend on --seed: runs with different seeds compare on one set


@dataclass
class Run:
    """Everything a training loop holds; built by `setup`, advanced by `train_loop`."""

    cfg: TrainConfig
    mcfg: ModelConfig
    env: DistEnv
    topo: Topology
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    schedule: WarmupCosine
    sampler: BatchSampler
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
    autocast: Callable
    out: Path
    info: dict  # what run.json records
    loss_fn: Callable = lm_loss  # (logits, targets) -> mean loss; vocab-parallel under tensor parallelism
    runner: Any = None  # the pipeline executor (chapter 09), None without pipeline parallelism
    param_counts: dict = field(default_factory=dict)  # of the full model, whatever part of it this rank holds
    start_step: int = 0

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def log(self, text: str) -> None:
        if self.is_main:
            print(text, flush=True)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train as `cfg` says; return a summary (losses by step, validation losses, throughput, final figures)."""
    check_config(cfg)
    env = DistEnv.detect()
    dims = resolve_parallel_dims(cfg, env.world_size)  # before any process group: a bad layout fails fast
    device = pick_device(cfg, env)
    topo, created_group = init_distributed(dims, env, device)
    try:
        run = setup(cfg, env, topo, device)
        restore(run)
        return train_loop(run)
    finally:
        if created_group:
            dist.destroy_process_group()


def setup(cfg: TrainConfig, env: DistEnv, topo: Topology, device: torch.device) -> Run:
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    mcfg = model_config(cfg)
    corpus = load_data(cfg)
    model, loss_fn, counts = build_parallel_model(mcfg, cfg, topo, device)
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, betas=(cfg.beta1, cfg.beta2))
    sampler = BatchSampler(corpus.train, cfg.seq_len, cfg.batch_size, cfg.seed)
    run = Run(cfg=cfg, mcfg=mcfg, env=env, topo=topo, device=device, model=model, optimizer=optimizer,
              schedule=lr_schedule(cfg), sampler=sampler, val_batches=validation_batches(corpus, cfg, device),
              autocast=autocast_for(cfg.dtype, device), out=Path(cfg.out), info={}, loss_fn=loss_fn,
              runner=pipeline_runner(model, topo, cfg, with_aux=mcfg.moe.n_experts > 0), param_counts=counts)
    run.info = describe_run(run, corpus)
    run.optimizer = data_parallel(run.model, run.optimizer, topo, cfg.zero)  # after describe_run: ZeRO-3 frees
    if run.is_main:
        run.out.mkdir(parents=True, exist_ok=True)
    return run


def data_parallel(model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology, zero: int) -> Any:
    """Chapter 07: average gradients over the dp_cp group, with the optimizer state (1), gradients (2) and
    parameters (3) sharded by ZeRO. One replica without ZeRO: the optimizer itself."""
    if topo.size("dp_cp") == 1 and zero == 0:
        return optimizer
    from minidist.parallel import ZeroOptimizer

    return ZeroOptimizer(model, optimizer, topo.comm("dp_cp"), stage=zero)


def load_data(cfg: TrainConfig) -> Corpus:
    try:
        corpus = load_corpus(None if cfg.data == "stdlib" else cfg.data, cfg.val_fraction, cfg.max_bytes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if corpus.train.numel() < cfg.seq_len + 1:
        raise ConfigError(f"the training split has {corpus.train.numel():,} tokens, fewer than seq_len + 1 = "
                          f"{cfg.seq_len + 1}; use more data or a shorter --seq-len")
    return corpus


def validation_batches(corpus: Corpus, cfg: TrainConfig, device: torch.device) -> list:
    """Fixed validation micro-batches (the same rows every evaluation); empty if there is no validation split."""
    if corpus.val.numel() < cfg.seq_len + 1:
        return []
    sampler = BatchSampler(corpus.val, cfg.seq_len, cfg.batch_size // cfg.microbatches, VAL_SEED)
    return [tuple(t.to(device) for t in sampler.batch(i)) for i in range(cfg.eval_batches)]


def describe_run(run: Run, corpus: Corpus) -> dict[str, Any]:
    """What run.json records: the resolved settings and the numbers every figure of the run is measured against."""
    cfg, mcfg = run.cfg, run.mcfg
    peak, peak_source = peak_flops_for(cfg, run.device)
    return {
        "config": config_to_values(cfg),
        "model": dataclasses.asdict(mcfg),
        "world_size": run.env.world_size,
        "parallel": dataclasses.asdict(run.topo.dims),
        "device": str(run.device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "corpus": corpus.description,
        "train_tokens": corpus.train.numel(),
        "val_tokens": corpus.val.numel(),
        "unigram_entropy_nats": unigram_entropy_nats(corpus.train),
        **run.param_counts,
        "tokens_per_step": cfg.batch_size * cfg.seq_len,
        "flops_per_token": flops.flops_per_token(mcfg, cfg.seq_len),
        "peak_flops": peak,
        "peak_flops_source": peak_source,
    }


def peak_flops_for(cfg: TrainConfig, device: torch.device) -> tuple[float, str]:
    """Peak FLOP/s of one device for MFU, and where the number comes from."""
    if cfg.peak_flops:
        return cfg.peak_flops, "the peak set by --peak-flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for chip, key in (("H200", "H200"), ("H100 PCIe", "H100-PCIe"), ("H100", "H100-SXM"), ("A100", "A100")):
            if chip in name:
                return flops.peak_flops(key), f"datasheet dense bf16 peak of {key} ({name})"
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    peak = flops.measure_peak_flops(dtype, size=1024, device=device)
    return peak, f"measured {'CPU' if device.type == 'cpu' else device.type} matmul peak (1024^3, {cfg.dtype})"


def restore(run: Run) -> None:
    """With --resume, load the latest checkpoint in OUT (if any). Without it, clear OUT's old checkpoints."""
    root = run.out / "checkpoints"
    step = checkpoint.latest_step(root) if run.cfg.resume else None
    if step is None:
        if run.cfg.resume:
            run.log(f"--resume: no checkpoint in {root}; starting at step 0")
        elif run.is_main:
            checkpoint.remove_checkpoints(root)
        _start_metrics(run.out / "metrics.jsonl", keep_before=0, is_main=run.is_main)
        return
    try:
        state, meta = checkpoint.load_checkpoint(root, step, rank=run.env.rank, world_size=run.env.world_size)
        _check_same_run(meta["config"], config_to_values(run.cfg))
        run.schedule.load_state_dict(state["schedule"])
        run.sampler.load_state_dict(state["sampler"])
    except ValueError as e:
        raise ConfigError(f"cannot resume from {root / checkpoint.step_dir_name(step)}: {e}") from None
    run.model.load_state_dict(state["model"])
    run.optimizer.load_state_dict(state["optimizer"])
    _set_rng_state(state["rng"])
    run.start_step = step
    run.info["resumed_from"] = step
    _start_metrics(run.out / "metrics.jsonl", keep_before=step, is_main=run.is_main)
    run.log(f"resumed from {root / checkpoint.step_dir_name(step)}")


# Settings a resumed run must share with the checkpoint (the rest, e.g. --eval-every or --dtype, may change).
SAME_RUN_KEYS = ("model", "data", "max_bytes", "val_fraction", "batch_size", "seq_len", "seed")


def _check_same_run(saved: dict, now: dict) -> None:
    diffs = [f"{k} {saved.get(k)!r} -> {now[k]!r}" for k in SAME_RUN_KEYS if saved.get(k) != now[k]]
    if diffs:
        raise ValueError(f"settings differ from the checkpoint's: {'; '.join(diffs)}")


def _start_metrics(path: Path, keep_before: int, is_main: bool) -> None:
    """Keep the records of steps < keep_before (those a resumed run does not redo), drop the rest."""
    if not is_main:
        return
    kept = [r for r in read_metrics(path) if r["step"] < keep_before] if keep_before and path.exists() else []
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)


def _rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run: Run, steps_done: int) -> None:
    """Checkpoint after `steps_done` optimizer steps: this rank's state, plus meta.json from rank 0."""
    state = {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
             "schedule": run.schedule.state_dict(), "sampler": run.sampler.state_dict(), "rng": _rng_state()}
    meta = {"config": config_to_values(run.cfg), "parallel": dataclasses.asdict(run.topo.dims)}
    barrier = dist.barrier if run.env.world_size > 1 else None
    checkpoint.save_checkpoint(run.out / "checkpoints", steps_done, state, meta, rank=run.env.rank,
                               world_size=run.env.world_size, barrier=barrier)


def _is_due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and (step + 1) % every == 0)


def train_loop(run: Run) -> dict[str, Any]:
    cfg, info = run.cfg, run.info
    moe = _moe_module(run.mcfg)
    metrics = MetricsWriter(run.out / "metrics.jsonl") if run.is_main else None
    if run.is_main:
        (run.out / "run.json").write_text(json.dumps(info, indent=2) + "\n")
    print_header(run)
    last = cfg.steps - 1
    summary: dict[str, Any] = {"steps": [], "losses": [], "val_losses": {}, "tokens_per_s": [], "mfu": []}
    clock = Clock(total=cfg.steps - run.start_step)
    for step in range(run.start_step, cfg.steps):
        started = time.perf_counter()
        lr = run.schedule.apply(run.optimizer, step)
        batches = local_batches(run.sampler, step, run.topo, cfg.microbatches, run.device)
        result = train_step(run.model, run.optimizer, batches, step=step, grad_clip=cfg.grad_clip,
                            autocast=run.autocast, with_aux=moe is not None, loss_fn=run.loss_fn,
                            runner=run.runner, topo=run.topo)
        if moe is not None and run.mcfg.moe.bias_update_speed > 0:
            # Replicas must see the same expert loads, or their router biases (and so their models) drift apart.
            replicas = run.topo.comm("dp_cp") if run.topo.size("dp_cp") > 1 else None
            moe.update_router_biases(run.model, reduce_fn=replicas.all_reduce if replicas else None)
        run.sampler.step = step + 1  # the sampler is a function of the step; its state is the next step
        seconds = time.perf_counter() - started
        record = make_record(run, step, lr, result, seconds, moe)
        if run.val_batches and _is_due(step, cfg.eval_every, last):
            val = evaluate(run.model, run.val_batches, run.autocast, run.loss_fn, run.runner)
            record["val_loss"] = global_mean(val, run.topo)
            summary["val_losses"][step] = record["val_loss"]
        if metrics:
            metrics.write(record)
        clock.tick()
        if _is_due(step, cfg.log_every, last) or step == run.start_step:
            run.log(progress_line(record, cfg.steps, clock))
        if cfg.ckpt_every > 0 and _is_due(step, cfg.ckpt_every, last):
            save(run, step + 1)
        for key, name in (("steps", "step"), ("losses", "loss"), ("tokens_per_s", "tokens_per_s"), ("mfu", "mfu")):
            summary[key].append(record[name])
    return finish(run, summary, clock)


def make_record(run: Run, step: int, lr: float, result: StepResult, seconds: float, moe: Any) -> dict[str, Any]:
    tokens_per_s = run.info["tokens_per_step"] / seconds
    peak_all = run.info["peak_flops"] * run.env.world_size
    record = {"step": step, "loss": global_mean(result.loss, run.topo), "lr": lr, "grad_norm": result.grad_norm,
              "tokens_per_s": tokens_per_s, "mfu": flops.mfu(tokens_per_s, run.info["flops_per_token"], peak_all),
              "step_s": seconds}
    if moe is not None:
        record["aux_loss"] = result.aux_loss
        record.update(_jsonable(moe.moe_stats(run.model)))
    return record


def _moe_module(mcfg: ModelConfig) -> Any:
    if mcfg.moe.n_experts > 0:
        from minidist.model import moe

        return moe
    return None


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


class MetricsWriter:
    """Appends one JSON object per optimizer step to metrics.jsonl, flushed at once (a crash loses nothing)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


class Clock:
    """Wall time since the loop began and the estimated time to finish."""

    def __init__(self, total: int) -> None:
        self.start = time.perf_counter()
        self.total = total
        self.done = 0

    def tick(self) -> None:
        self.done += 1

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def eta(self) -> float:
        return self.elapsed / max(self.done, 1) * (self.total - self.done)


def _fmt_time(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def print_header(run: Run) -> None:
    cfg, info = run.cfg, run.info
    entropy = info["unigram_entropy_nats"]
    dims = " ".join(f"{k}{v}" for k, v in info["parallel"].items())
    run.log(f"minidist.train: model {cfg.model} ({info['params'] / 1e6:.2f}M parameters, "
            f"{info['params_non_embedding'] / 1e6:.2f}M non-embedding), world {info['world_size']} ({dims}), "
            f"{info['device']}, {cfg.dtype}, {info['threads']} threads")
    run.log(f"data: {info['corpus']}")
    run.log(f"unigram entropy of the training split: {entropy:.4f} nats/token ({entropy / math.log(2):.3f} bits): "
            "the loss of a model that knows only byte frequencies")
    run.log(f"batch {cfg.batch_size} x {cfg.seq_len} = {info['tokens_per_step']:,} tokens/step in "
            f"{cfg.microbatches} micro-batch(es); {cfg.steps} steps; lr {cfg.lr:g} -> {cfg.min_lr:g} "
            f"after {cfg.warmup_steps} warm-up steps")
    run.log(f"mfu vs {info['peak_flops_source']}: {info['peak_flops'] / 1e9:,.1f} GFLOP/s; "
            f"{info['flops_per_token'] / 1e6:.2f} MFLOP/token; writing {run.out}/")


def progress_line(record: dict[str, Any], steps: int, clock: Clock) -> str:
    width = len(str(steps))
    line = (f"step {record['step'] + 1:>{width}}/{steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"grad_norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
            f"MFU {record['mfu']:.1%} | ETA {_fmt_time(clock.eta)}")
    if "val_loss" in record:
        line += f" | val_loss {record['val_loss']:.4f}"
    return line


def _parameters(run: Run) -> Iterable[torch.Tensor]:
    """The full parameters in model order (ZeRO-3 gathers them from the shards: collective)."""
    if hasattr(run.optimizer, "full_parameters"):
        return run.optimizer.full_parameters().values()
    return run.model.parameters()


def finish(run: Run, summary: dict[str, Any], clock: Clock) -> dict[str, Any]:
    """The loss curve, the final figures in run.json, one closing line; returns the summary."""
    info = run.info
    summary.update(
        out=str(run.out), elapsed_s=clock.elapsed, unigram_entropy_nats=info["unigram_entropy_nats"],
        final_loss=summary["losses"][-1] if summary["losses"] else None,
        final_val_loss=summary["val_losses"][max(summary["val_losses"])] if summary["val_losses"] else None,
        mean_tokens_per_s=_mean_after_first(summary["tokens_per_s"]), mean_mfu=_mean_after_first(summary["mfu"]),
        resumed_from=info.get("resumed_from"),
        param_hash=health.replica_hash(_parameters(run)),  # replicas of one run must agree on it
    )
    if not run.is_main:
        return summary
    final = {k: summary[k] for k in ("elapsed_s", "final_loss", "final_val_loss", "mean_tokens_per_s", "mean_mfu",
                                     "param_hash")}
    (run.out / "run.json").write_text(json.dumps({**info, "final": final}, indent=2) + "\n")
    if run.cfg.plot:
        records = read_metrics(run.out / "metrics.jsonl")
        plot_losses(records, run.out / "loss.png", baseline=info["unigram_entropy_nats"],
                    title=f"{run.cfg.model}: {run.cfg.batch_size}x{run.cfg.seq_len} tokens/step")
    tail = summary["losses"][-10:]
    val = f", val {summary['final_val_loss']:.4f}" if summary["final_val_loss"] is not None else ""
    run.log(f"done: {len(summary['steps'])} steps in {_fmt_time(clock.elapsed)}; train loss "
            f"{sum(tail) / max(len(tail), 1):.4f} (mean of the last {len(tail)}){val}; unigram entropy "
            f"{info['unigram_entropy_nats']:.4f}; {summary['mean_tokens_per_s']:,.0f} tok/s, "
            f"MFU {summary['mean_mfu']:.1%}")
    return summary


def _mean_after_first(values: list[float]) -> float:
    """Mean throughput figure, leaving out the first step (it pays one-time costs: allocation, kernel warm-up)."""
    values = values[1:] or values
    return sum(values) / len(values) if values else 0.0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        train(parse_config(argv))
    except ConfigError as e:
        if DistEnv.detect().rank == 0:  # every rank sees the same bad setting; say it once
            print(f"error: {e}", file=sys.stderr)
        return 2
    except health.TrainingDiverged as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
