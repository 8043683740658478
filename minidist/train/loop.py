"""The trainer: `python -m minidist.train` on one process, `torchrun --nproc_per_node=N -m minidist.train` on N.

Read it top to bottom:

1. `train(cfg)`: check the settings, the layout and OUT (`minidist.train.preflight`: one-line errors before any
   process group exists; a run in OUT is never replaced unless --overwrite says so), join the process group
   (`minidist.comm.bootstrap`), `setup`, resume, `train_loop`.
2. `setup`: the corpus, the model's structure on the meta device, and `parallelize` (in `minidist.parallel`), which
   applies the parallel dimensions in one order, fills only this rank's parameters from (seed, parameter names)
   (`minidist.parallel.materialize`) and returns a `ParallelModel`: the only object the loop talks to, whatever
   the layout. Everything the loop holds is one `Run` record (`minidist.train.run`).
3. `train_step`: forward and backward over the micro-batches, clip, check, step.
4. `train_loop`: steps, logging (`minidist.train.metrics`), evaluation, checkpoints (`minidist.train.run_state`);
   `finish` writes the final figures and the loss curve.

Outputs in OUT/: `run.json` (resolved settings, corpus, parameter counts, unigram entropy, FLOPs per token, the
peak FLOP/s used for MFU and its source; final figures added at the end), `metrics.jsonl` (one object per optimizer
step: `step` is the 0-based step index, `loss` the mean LM loss of its global batch before the update, `lr`,
`grad_norm` before clipping, `tokens_per_s`, `mfu`, `step_s` (the mean over the step's logging window: see
`train_loop`); `val_loss` after the update on evaluation steps;
`aux_loss` and `moe_*` for MoE models; `compiles` with --compile: the frames dynamo compiled in the step),
`loss.png`, `tensorboard/` (--tensorboard: minidist.train.dashboard), `profile/`
(--profile-steps: minidist.train.profiling), and `checkpoints/` (see minidist.train.checkpoint); on a failure,
a timeout or SIGTERM/SIGUSR1, `flight/rank{R}.json` (`minidist.comm.recorder`; `python -m minidist.debug diff`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minidist import flops, out_files, precision
from minidist.comm.bootstrap import DistEnv, joined
from minidist.comm.topology import Topology
from minidist.data.sampler import BatchSampler
from minidist.data.shards import ShardChanged
from minidist.data.training_data import TrainingData
from minidist.flops import MFU_CONVENTION, MfuMeter, peak_for_device
from minidist.model.documents import attention_pairs, document_ids
from minidist.model.fp8_linear import Fp8Recipe, convert_to_fp8, gemm_kernels, quantization_snr
from minidist.model.moe.stats import moe_layers
from minidist.parallel import Layout, ParallelModel, StepLosses, materialize, parallelize
from minidist.parallel.pp.schedules import ZB_SCHEDULES
from minidist.train import metrics, profiling, reporting, run_dir, run_state
from minidist.train.blocks import (
    apply_recompute,
    compile_blocks,
    frames_compiled,
    keep_gemms_eager,
    resolve_compile,
    use_attention_kernel,
)
from minidist.train.config import (
    ConfigError,
    RankConfigError,
    TrainConfig,
    config_to_values,
    lr_schedule,
    model_config,
    parse_config,
)
from minidist.train.dashboard import Dashboard
from minidist.train.optim import build_optimizer
from minidist.train.plots import plot_losses, read_metrics
from minidist.train.preflight import load_data, preflight  # load_data: also this module's public name
from minidist.train.profiling import StepProfiler
from minidist.train.run import Run
from minidist.trust import faults, health, replicas

# the summary's lists and the record field each takes, step by step (compiles: this rank's; metrics.jsonl has rank 0's)
SUMMARY_KEYS = (("steps", "step"), ("losses", "loss"), ("tokens_per_s", "tokens_per_s"), ("mfu", "mfu"),
                ("compiles", "compiles"))
VAL_SEED = 20240101  # validation batches do not depend on --seed: runs with different seeds compare on one set


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train as `cfg` says; return a summary (losses by step, validation losses, throughput, final figures)."""
    checked = preflight(cfg)  # before any process group: bad settings and layouts fail fast, in one line
    env, device = checked.env, checked.device
    corpus = load_data(cfg)  # before the process group too: data missing or damaged on one node is its rank's line
    # One run at a time in OUT (rank 0 holds its lock); the process groups; on a failure each rank writes
    # OUT/flight/ (a bad setting is no communication failure).
    with run_dir.locked(Path(cfg.out), env.rank == 0), contextlib.ExitStack() as stack:
        with reporting.rendezvous(reporting.rendezvous_address(), cfg.comm_timeout):
            topo = stack.enter_context(joined(checked.layout.dims, env, device, cfg.comm_timeout, Path(cfg.out),
                                              ignore=(ConfigError,), ckpt_timeout_s=cfg.ckpt_timeout))
        run = setup(cfg, checked.layout, env, topo, device, corpus)
        resume(run)
        return train_loop(run)


def setup(cfg: TrainConfig, layout: Layout, env: DistEnv, topo: Topology, device: torch.device,
          corpus: TrainingData | None = None) -> Run:
    """Everything a run holds, for `layout` (`preflight.resolve_layout`) on `topo` (its process groups), on
    `corpus` (`load_data(cfg)` when not given)."""
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    mcfg = model_config(cfg)
    corpus = corpus if corpus is not None else load_data(cfg)
    model = materialize.meta_model(mcfg)  # structure only: parallelize fills just what this rank keeps
    for layer in moe_layers(model):  # --expert-backend: before ep swaps the experts (it keeps their backend)
        layer.experts.backend = cfg.expert_backend
    convert_to_fp8(model, None if cfg.fp8 == "none" else Fp8Recipe(cfg.fp8, cfg.fp8_block))  # before tp shards it
    use_attention_kernel(model, cfg.attention_kernel)  # before cp would swap the cores (refused together)
    if layout.recompute != "none":
        apply_recompute(model, layout.recompute)
    compiled = resolve_compile(cfg.compile, device)
    split = layout.dims.pp > 1 and cfg.schedule in ZB_SCHEDULES  # B and W apart (parallel.pp.split_backward)
    if compiled:
        compile_blocks(model, cfg.compile_backend)  # lazily, at the first forward
    precision.configure_matmuls(device)
    autocast = precision.autocast_for(precision.resolve_dtype(cfg.dtype, device), device)
    counts = parameter_counts(model)
    make_optimizer = functools.partial(build_optimizer, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                       betas=(cfg.beta1, cfg.beta2))
    parallel = parallelize(model, mcfg, topo, layout.options, make_optimizer,
                           materialize.materializer(mcfg, cfg.seed, device))
    if compiled and split:
        keep_gemms_eager(model)  # W runs the weight GEMMs, outside the compiled graphs
    run = Run(cfg=cfg, mcfg=mcfg, env=env, topo=topo, device=device, parallel=parallel, schedule=lr_schedule(cfg),
              sampler=BatchSampler(corpus.train, cfg.seq_len, cfg.batch_size, cfg.seed),
              val_batches=validation_batches(corpus, cfg, device), autocast=autocast,
              out=Path(cfg.out), info={}, eod_id=corpus.eod_id if cfg.doc_mask else None)
    run.val_docs = [document_ids(inputs, run.eod_id) for inputs, _ in run.val_batches] if cfg.doc_mask else None
    run.info = describe_run(run, corpus, counts)
    check_fault_target(run)  # before OUT is touched: a bad drill leaves no run behind
    run_dir.prepare_out(run.out, overwrite=cfg.overwrite, is_main=run.is_main,
                        barrier=run.barrier)
    if run.is_main:  # the run's tokenizer beside its outputs (bytes too): what decodes its samples and checkpoints
        out_files.replace_file(run.out / "tokenizer.json", corpus.tokenizer_json)
    if env.world_size > 1:
        if run.is_main and device.type == "cuda":  # where NCCL's watchdog writes its record (bootstrap.joined)
            (run.out / "flight").mkdir(exist_ok=True)
        run_dir.check_shared(run.out, topo.checkpoint_comm(), device)  # before a checkpoint depends on it
    return run


def parameter_counts(model: nn.Module) -> dict[str, int]:
    params = sum(p.numel() for p in model.parameters())  # a tied weight is counted once
    embedding = sum(p.numel() for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters())
    return {"params": params, "params_non_embedding": params - embedding}


def validation_batches(corpus: TrainingData, cfg: TrainConfig, device: torch.device) -> list:
    """Fixed validation micro-batches (the same rows every evaluation); empty if there is no validation split.
    The rows are --eval-batches batches of --batch-size rows whatever --microbatches is (each batch is then cut into
    micro-batches as a training batch is): a resume with other micro-batches keeps the same validation set."""
    if corpus.val.numel() < cfg.seq_len + 1:
        return []
    sampler = BatchSampler(corpus.val, cfg.seq_len, cfg.batch_size, VAL_SEED)
    return [tuple(to_device(t, device) for t in pair) for i in range(cfg.eval_batches)
            for pair in zip(*(part.chunk(cfg.microbatches) for part in sampler.batch(i)))]


def local_batches(sampler: BatchSampler, step: int, topo: Topology, microbatches: int, device: torch.device,
                  eod_id: int | None = None
                  ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list | None, torch.Tensor | None]:
    """This rank's rows of the global batch of `step`, split into micro-batches of (inputs, targets); with `eod_id`
    (--doc-mask) each micro-batch's document ids, computed on the host from the rows the sampler gave (then sent
    with them), and the (query, key) pairs their attention keeps, for MFU (a 0-d tensor on the host; else None)."""
    inputs, targets = sampler.shard(step, topo.coord("dp"), topo.size("dp"))
    ids = document_ids(inputs, eod_id) if eod_id is not None else None
    pairs = attention_pairs(ids) if ids is not None else None
    docs = list(to_device(ids, device).chunk(microbatches)) if ids is not None else None
    inputs, targets = to_device(inputs, device), to_device(targets, device)
    return list(zip(inputs.chunk(microbatches), targets.chunk(microbatches))), docs, pairs


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (the sampler's rows) on `device` without the host waiting: on CUDA a copy from pageable memory
    is staged and waited for (a stream sync); from pinned memory with non_blocking it is queued on the stream like
    a kernel. On a CPU nothing is pinned (a CUDA build's allocator) and nothing moves."""
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)


def describe_run(run: Run, corpus: TrainingData, counts: dict[str, int]) -> dict[str, Any]:
    """What run.json records: the resolved settings and the numbers every figure of the run is measured against."""
    cfg, mcfg = run.cfg, run.mcfg
    dtype = precision.resolve_dtype(cfg.dtype, run.device)
    micro_tokens = cfg.batch_size // (run.topo.size("dp") * cfg.microbatches) * cfg.seq_len  # one matmul's rows
    peak_dtype = dtype if cfg.fp8 == "none" else "fp8"  # MFU against the FP8 peak when the GEMMs run in FP8
    peak, peak_source = peak_for_device(run.device, peak_dtype, cfg.peak_flops, mcfg, micro_tokens)
    return {
        "config": config_to_values(cfg), "model": dataclasses.asdict(mcfg), "world_size": run.env.world_size,
        "parallel": dataclasses.asdict(run.topo.dims), "device": str(run.device), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "corpus": corpus.description, "train_tokens": corpus.train.numel(),
        "val_tokens": corpus.val.numel(), "unigram_entropy_nats": corpus.unigram_entropy_nats, **counts,
        "eod_id": corpus.eod_id, "data_identity": corpus.identity(),
        "tokens_per_step": cfg.batch_size * cfg.seq_len, "flops_per_token": flops.flops_per_token(mcfg, cfg.seq_len),
        "mfu_flops_per_token": flops.mfu_flops_per_token(mcfg, cfg.seq_len), "mfu_convention": MFU_CONVENTION,
        "peak_flops": peak, "peak_flops_source": peak_source, "dtype": dtype,
        "compile": resolve_compile(cfg.compile, run.device),
        "fp8_gemms": gemm_kernels(None if cfg.fp8 == "none" else Fp8Recipe(cfg.fp8, cfg.fp8_block), run.device),
    }


def resume(run: Run) -> None:
    """--resume: continue from OUT's latest checkpoint; otherwise start at step 0 (OUT holds no run by now)."""
    try:
        step = run_state.restore_run(run)
    except ValueError as e:  # maybe this rank's file alone: every rank says its own (main)
        raise rank_error(run, f"cannot resume from {run.out / 'checkpoints'}: {e}") from None
    if step is None and run.cfg.resume:
        run.log(f"--resume: no checkpoint in {run.out / 'checkpoints'}; starting at step 0")
    if step is not None:
        run.start_step = run.info["resumed_from"] = step
        run.log(f"resumed from {run_state.checkpoint_dir(run.out / 'checkpoints', step)}")
    if run.is_main:
        metrics.start_metrics(run.out / "metrics.jsonl", keep_before=step)


def train_step(parallel: ParallelModel, batches: list[tuple[torch.Tensor, torch.Tensor]], *, step: int,
               grad_clip: float, autocast: Callable = contextlib.nullcontext, healthy: torch.Tensor | None = None,
               docs: list[torch.Tensor] | None = None,
               label: Callable[[str], contextlib.AbstractContextManager] = profiling.no_label
               ) -> tuple[StepLosses, torch.Tensor, torch.Tensor]:
    """One optimizer step on this rank's micro-batches of one global batch; returns (losses, grad norm before
    clipping, healthy), all on the device: nothing here waits for it. `healthy` (a bool tensor) stays True while
    every loss and gradient norm so far is finite; once False, the update of this step and of every later one is
    skipped on the device (`ParallelModel.step`), so the weights stay those before the first non-finite step until
    the loop reads its figures and stops (TrainingDiverged, naming that step as the progress line does). `docs`:
    the micro-batches' document ids (--doc-mask). `label(name)` opens a range of a --profile-steps trace around
    each phase (minidist.train.profiling)."""
    with label("forward_backward"):
        losses = parallel.forward_backward_on_device(batches, autocast, docs)
    with label("clip_grad_norm"):  # where data parallelism waits for its gradient buckets
        grad_norm = parallel.clip_grad_norm_(grad_clip)
    healthy = health.finite_on_device(losses.loss, grad_norm, healthy)
    with label("optimizer_step"):
        parallel.step(apply=healthy)
    return losses, grad_norm, healthy


def inject_fault(run: Run, step: int) -> None:
    """--inject-fault's drill after this step's update; a drill this layout cannot run is a bad setting."""
    try:
        faults.inject(run.cfg.inject_fault, step, run.env.rank, run.parallel.model, params_sharded=run.cfg.zero == 3)
    except faults.FaultError as e:
        raise ConfigError(str(e)) from None


def check_fault_target(run: Run) -> None:
    """--inject-fault's parameter exists on the rank that flips it (that rank's one-line error otherwise)."""
    text = run.cfg.inject_fault
    if text is None or faults.parse_fault(text).rank != run.env.rank:
        return
    try:
        faults.fault_target(text, run.env.rank, run.parallel.model, params_sharded=run.cfg.zero == 3)
    except faults.FaultError as e:
        raise rank_error(run, str(e)) from None


def rank_error(run: Run, message: str) -> RankConfigError:
    """A bad input this rank found, maybe alone: main prints it on every rank that raises it, naming the rank."""
    return RankConfigError(message if run.env.world_size == 1 else f"rank {run.env.rank}: {message}")


def train_loop(run: Run) -> dict[str, Any]:
    """The steps, reading their figures on the host only on logging steps (and on evaluation, replica-check and
    checkpoint steps, at --stop-after and at the end): a step in between queues its work and goes on, its loss, grad
    norm and MoE figures waiting on the device, so a GPU's host never waits for it. A read synchronizes
    the device, stops the clock and writes the window's records to metrics.jsonl together, one per step: `step_s`
    (and `tokens_per_s`, `mfu`) of each step is the mean over its logging window, the window's time (from the end
    of the previous read, evaluation or checkpoint to the synchronized end of its last step) over its steps."""
    # `last` keeps the cadence of --steps for evaluations and checks (a stopped and resumed run logs what a straight
    # run does); `stopping`, the last step of this run (--stop-after's), always prints its progress line.
    cfg, info, last = run.cfg, run.info, run.cfg.steps - 1
    stopping = run_state.end_step(cfg) - 1
    writer = metrics.MetricsWriter(run.out / "metrics.jsonl") if run.is_main else None
    board = Dashboard(run.out, run.start_step) if run.is_main and cfg.tensorboard else None
    profiler = StepProfiler(cfg.profile_steps, cfg.steps, run.out, run.env.rank, run.device)
    if run.is_main:
        out_files.replace_file(run.out / "run.json", (json.dumps(info, indent=2) + "\n").encode())
    for line in [*metrics.header_lines(cfg, info, run.out), profiler.skipped(run.start_step)]:
        if line:
            run.log(line)
    summary: dict[str, Any] = {"val_losses": {}, **{key: [] for key, _ in SUMMARY_KEYS}}
    clock = metrics.Clock(total=run_state.end_step(cfg) - run.start_step)
    meter = MfuMeter(info["mfu_flops_per_token"], info["peak_flops"] * run.env.world_size,
                     datasheet=info["peak_flops_source"].startswith("datasheet"))
    pending: list[dict[str, Any]] = []  # the window's steps, their figures still on the device
    healthy, started = None, time.perf_counter()
    for step in range(run.start_step, run_state.end_step(cfg)):  # --stop-after ends it early
        with profiler.step(step, run.autocast) as (autocast, label):  # labelled only in --profile-steps
            figures, healthy = run_step(run, step, healthy, autocast, label)
        pending.append(figures)
        clock.tick()
        logging = _is_due(step, cfg.log_every, last) or step in (run.start_step, stopping)
        if not (logging or any(_is_due(step, every, last) for every in (cfg.eval_every, cfg.check_every))
                or run_state.checkpoint_due(cfg, step)):
            continue
        records = read_window(run, pending, meter, started)
        pending = []
        if run.val_batches and _is_due(step, cfg.eval_every, last):
            with quantization_snr(run.parallel.model, enabled=cfg.fp8 != "none") as snr:  # FP8: per-layer SNR
                records[-1]["val_loss"] = summary["val_losses"][step] = run.parallel.evaluate(
                    run.val_batches, run.autocast, run.val_docs)
            if snr:
                records[-1]["fp8_snr_db"] = snr
        if writer:
            writer.write_many(records)
        if board:
            board.write(records)  # the figures just read: no host read of its own
        for record in records:
            for key, name in SUMMARY_KEYS:
                summary[key].append(record.get(name))
        if logging:
            run.log(metrics.progress_line(records[-1], cfg.steps, clock))
        if _is_due(step, cfg.check_every, last):  # run_state checks at every checkpoint and resume too
            replicas.check_model(run.parallel, f"check after step {step}")
        run_state.checkpoint_if_due(run, step)  # every --ckpt-every steps, at the end and at --stop-after
        started = time.perf_counter()  # evaluations, checks and checkpoints are no step's time
    profiler.close()  # a run stopped inside --profile-steps (--stop-after) writes the steps it ran
    if board:
        board.close()
    return finish(run, summary, clock, meter)


def run_step(run: Run, step: int, healthy: torch.Tensor | None, autocast: Callable, label: Callable
             ) -> tuple[dict[str, Any], torch.Tensor]:
    """Step `step`'s work, queued: its learning rate and its figures still on the device, and `healthy`."""
    lr = run.schedule.apply(run.parallel.optimizer, step)
    compiled_before = frames_compiled()
    batches, docs, pairs = local_batches(run.sampler, step, run.topo, run.cfg.microbatches, run.device, run.eod_id)
    losses, grad_norm, healthy = train_step(run.parallel, batches, step=step, grad_clip=run.cfg.grad_clip,
                                            autocast=autocast, healthy=healthy, docs=docs, label=label)
    run.sampler.step = step + 1  # the sampler is a function of the step; its state is the next step
    inject_fault(run, step)
    device = {"loss": losses.loss, "grad_norm": grad_norm}
    if run.mcfg.moe.n_experts > 0:
        device.update(aux_loss=losses.aux_loss, **run.parallel.moe_stats_on_device())
    figures = {"step": step, "lr": lr, "device": device, "pairs": pairs}
    if run.info["compile"]:  # frames dynamo compiled in this step (a host counter): none once the run is steady
        figures["compiles"] = frames_compiled() - compiled_before
    return figures, healthy


def read_window(run: Run, pending: list[dict[str, Any]], meter: MfuMeter, started: float) -> list[dict[str, Any]]:
    """The records of a logging window's steps: wait for the device, time the window, read every figure in one
    transfer, and stop (TrainingDiverged) at the first step whose loss or grad norm is not finite, after writing
    the records of the steps before it."""
    metrics.synchronize(run.device)
    seconds = (time.perf_counter() - started) / len(pending)
    values = metrics.read_figures([p["device"] for p in pending], run.device)
    peak_mem = metrics.peak_memory_per_rank(run.device, run.topo.comm("world"))
    tokens, records = run.info["tokens_per_step"], []
    step_flops = window_flops(run, pending)
    for p, figures, done in zip(pending, values, step_flops):
        try:
            health.check_finite(p["step"] + 1, figures["loss"], figures["grad_norm"])  # "step 3/200" is index 2
        except health.TrainingDiverged:
            if run.is_main:
                metrics.MetricsWriter(run.out / "metrics.jsonl").write_many(records)
            raise
        mfu, note = meter.step(tokens, seconds, count=p["step"] > run.start_step, flops=done)
        if note:
            run.log(note)
        records.append({"step": p["step"], "loss": figures.pop("loss"), "lr": p["lr"],
                        "grad_norm": figures.pop("grad_norm"), "mfu": mfu, "step_s": seconds,
                        "tokens_per_s": tokens / seconds, "peak_mem_bytes": peak_mem, **figures,
                        **({"compiles": p["compiles"]} if "compiles" in p else {})})
    return records


def window_flops(run: Run, pending: list[dict[str, Any]]) -> list[float | None]:
    """--doc-mask: the model FLOPs of each step of the window, with the attention its document masks kept (every
    dp rank counted its own rows on the host: one small all-reduce per logging window sums them, read with the
    window's figures); else None each (the dense causal count, `MfuMeter`'s own)."""
    if run.eod_id is None:
        return [None] * len(pending)
    pairs = torch.stack([p["pairs"] for p in pending]).to(run.device)
    if run.topo.size("dp") > 1:
        run.topo.comm("dp").all_reduce(pairs)
    return [flops.step_flops(run.mcfg, run.info["tokens_per_step"], n) for n in pairs.tolist()]


def _is_due(step: int, every: int, last: int) -> bool:
    return step == last or (every > 0 and (step + 1) % every == 0)


def finish(run: Run, summary: dict[str, Any], clock: metrics.Clock, meter: MfuMeter) -> dict[str, Any]:
    """The loss curve, the final figures in run.json, one closing line; returns the summary."""
    info = run.info
    summary.update(
        out=str(run.out), elapsed_s=clock.elapsed, unigram_entropy_nats=info["unigram_entropy_nats"],
        final_loss=summary["losses"][-1] if summary["losses"] else None,
        final_val_loss=summary["val_losses"][max(summary["val_losses"])] if summary["val_losses"] else None,
        mean_tokens_per_s=metrics.mean_after_first(summary["tokens_per_s"]),
        mean_mfu=metrics.mean_after_first(summary["mfu"]), resumed_from=info.get("resumed_from"),
        cumulative_mfu=meter.cumulative, final_peak_flops=meter.peak, peak_flops_raised_from=meter.raised_from,
        param_hash=health.replica_hash(run.parallel.full_parameters()),  # replicas of one run must agree on it
    )
    if not run.is_main:
        return summary
    final = {k: summary[k] for k in ("elapsed_s", "final_loss", "final_val_loss", "mean_tokens_per_s", "mean_mfu",
                                     "cumulative_mfu", "final_peak_flops", "peak_flops_raised_from", "param_hash")}
    out_files.replace_file(run.out / "run.json", (json.dumps({**info, "final": final}, indent=2) + "\n").encode())
    if run.cfg.plot:
        plot_losses(read_metrics(run.out / "metrics.jsonl"), run.out / "loss.png",
                    baseline=info["unigram_entropy_nats"],
                    title=f"{run.cfg.model}: {run.cfg.batch_size}x{run.cfg.seq_len} tokens/step")
    run.log(metrics.closing_line(summary, info["unigram_entropy_nats"]))
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: 0, or one line on stderr (and in torchrun's error file: `reporting`) on every rank that
    stops, 2 for bad input, 1 for a failure of the machine or the job."""
    try:
        train(parse_config(argv))
    except ConfigError as e:  # every rank says its own: a node's input may differ (a relative path, its files)
        return _stop(str(e) if isinstance(e, RankConfigError) else reporting.ranked(str(e)), 2)
    except reporting.JoinFailed as e:
        return _stop(reporting.ranked(str(e)), 1, consequence=True)
    except ShardChanged as e:
        return _stop(reporting.ranked(str(e)), 1)
    except OSError as e:  # the machine's, not the run's: a full disk while writing a checkpoint or OUT's files
        if e.errno is None and not str(e).startswith("cannot write"):
            raise  # not the filesystem's answer: keep its traceback
        return _stop(f"rank {reporting.place()[0]}: {(str(e).splitlines() or [type(e).__name__])[0]}", 1)
    except RuntimeError as e:  # TrainingDiverged, ReplicasDiffer, a peer silent past --comm-timeout: one line
        if (line := health.stop_reason(e, reporting.place()[0])) is None:
            raise  # a bug: keep its traceback
        return _stop(line, 1, consequence=not isinstance(e, health.TrainingDiverged))
    return 0


def _stop(line: str, code: int, consequence: bool = False) -> int:
    reporting.report(line, consequence=consequence)
    return code

