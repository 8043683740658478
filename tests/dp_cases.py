"""Chapter 07's multi-process cases: every data-parallel / ZeRO variant, run inside ONE launch per world size.

`results(world)` launches `world` gloo ranks once (cached for the test session); each rank runs every case of
`CASES` and returns what the tests compare with the single-device reference of tests/parity.py: the global mean
loss of every step, the step-0 gradient (rank 0, assembled by name), ledger bytes per step, memory counts.

Rank processes import this module, so it stays free of pytest.
"""

from __future__ import annotations

import contextlib
import functools
import io
import shutil
import tempfile
from pathlib import Path

import parity
import torch
import torch.distributed as dist

from minidist.comm.communicator import Ledger
from minidist.comm.launch import run_ranks
from minidist.comm.topology import ParallelDims, Topology
from minidist.model import ModelConfig, build_model, get_preset, lm_loss
from minidist.parallel import DataParallel, Timeline, ZeroOptimizer, average_gradients, split_batch
from minidist.trust.health import replica_hash

SMALL_BUCKET = 64 * 1024  # bytes: several buckets for the tiny test model, so ordering and overlap are exercised
# The parity model with mixture-of-experts MLPs (dropless top-2 of 4: every token's output is independent of the batch).
MOE_CFG: ModelConfig = get_preset("tiny", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64,
                                  moe=dict(n_experts=4, top_k=2))

# name -> (kind, stage, microbatches)
CASES: dict[str, tuple[str, int, int]] = {
    "naive_m1": ("naive", 0, 1),
    "naive_m2": ("naive", 0, 2),
    "bucketed_m1": ("bucketed", 0, 1),
    "bucketed_m2": ("bucketed", 0, 2),
    "overlap_m1": ("overlap", 0, 1),
    "overlap_m2": ("overlap", 0, 2),
    "broken_skip_sync": ("skip_sync", 0, 1),  # never averages: each rank steps on its own shard's gradient
    "broken_no_scale_m2": ("no_scale", 0, 2),  # forgets the 1/M of gradient accumulation
    **{f"zero{s}_m{m}": ("zero", s, m) for s in range(4) for m in (1, 2)},
}


def _train(kind: str, stage: int, microbatches: int, topo: Topology, steps: int = parity.STEPS,
           cfg: ModelConfig = parity.CFG, overlap: bool = True) -> dict:
    """Train `steps` steps of the parity setup under one variant; return losses, step-0 gradients, ledger per step.
    `overlap` is ZeRO's (DataParallel's follows the kind: "bucketed" does not overlap)."""
    rank, world = topo.coord("dp_cp"), topo.size("dp_cp")
    ledger = Ledger()
    comm = topo.comm("dp_cp", ledger)
    model = build_model(cfg, seed=parity.SEED)
    numel = sum(p.numel() for p in model.parameters())  # before ZeRO-3 frees them
    optimizer = parity.make_optimizer(model.parameters())
    timeline = Timeline()
    engine = None
    if kind in ("bucketed", "overlap", "no_scale"):
        engine = DataParallel(model, comm, bucket_bytes=SMALL_BUCKET, overlap=kind != "bucketed", timeline=timeline)
    elif kind == "zero":
        engine = ZeroOptimizer(model, optimizer, comm, stage, bucket_bytes=SMALL_BUCKET, overlap=overlap,
                               timeline=timeline)
    out: dict = {"losses": [], "ledger": [], "norms": [], "numel": numel}
    for step in range(steps):
        before = ledger.totals()
        timeline.reset()
        inputs, targets = parity.global_batch(step)
        batches = split_batch(inputs, targets, rank, world, microbatches)
        scale = 1.0 if kind == "no_scale" else 1.0 / microbatches
        total = torch.zeros(())
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            with engine.no_sync() if engine is not None and not last else contextlib.nullcontext():
                loss = lm_loss(model(x), y)
                (loss * scale).backward()
            total += loss.detach()
        if kind == "naive":
            average_gradients(model, comm)
        if isinstance(engine, DataParallel):
            engine.finish_grad_sync()
        # The step-0 gradient, before clipping, assembled by name (from shards for ZeRO 1-3); outside the ledger.
        if step == 0:
            side = Ledger()
            if isinstance(engine, ZeroOptimizer):
                engine.finish_grad_sync()
                saved, engine.comm.ledger = engine.comm.ledger, side
                grads = engine.full_gradients()
                engine.comm.ledger = saved
            else:
                grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            out["grads"] = grads if rank == 0 else None
        if isinstance(engine, ZeroOptimizer):
            out["norms"].append(engine.clip_grad_norm(parity.GRAD_CLIP))
            engine.step()
            engine.zero_grad()
        else:
            out["norms"].append(torch.nn.utils.clip_grad_norm_(model.parameters(), parity.GRAD_CLIP).item())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out["losses"].append((total / microbatches).item())
        after = ledger.totals()
        out["ledger"].append({k: {f: v[f] - before.get(k, {}).get(f, 0) for f in ("calls", "bytes")}
                              for k, v in after.items()})
        if step == 0:
            out["timeline"] = list(timeline.events)
    if isinstance(engine, ZeroOptimizer):
        out["memory"] = engine.memory_bytes()
        out["padded"] = engine.padded_numel
        out["buckets"] = len(engine.buckets)
        out["pieces"] = len(engine.grad_pieces()) if stage else sum(1 for _ in model.parameters())
        out["peak_transient"] = engine.peak_transient_bytes()
        out["unit_bytes"] = [4 * b.padded for b in engine.buckets]
        params = engine.full_parameters()
    else:
        params = {n: p.detach() for n, p in model.named_parameters()}
        if engine is not None:
            out["padded"] = sum(b.padded for b in engine.buckets)
            out["buckets"] = len(engine.buckets)
    out["replica_hash"] = replica_hash(params[n] for n in sorted(params))
    return out


def _checkpoint_case(stage: int, topo: Topology) -> dict:
    """Train 2 steps, save, train a 3rd; then rebuild from the save and redo the 3rd: it must be identical."""
    rank, world = topo.coord("dp_cp"), topo.size("dp_cp")

    def build():
        model = build_model(parity.CFG, seed=parity.SEED)
        zero = ZeroOptimizer(model, parity.make_optimizer(model.parameters()), topo.comm("dp_cp"), stage,
                             bucket_bytes=SMALL_BUCKET)
        return model, zero

    def train_step(model, zero, step):
        inputs, targets = parity.global_batch(step)
        (x, y), = split_batch(inputs, targets, rank, world, 1)
        loss = lm_loss(model(x), y)
        loss.backward()
        zero.clip_grad_norm(parity.GRAD_CLIP)
        zero.step()
        zero.zero_grad()
        return loss.item()

    model, zero = build()
    for step in range(2):
        train_step(model, zero, step)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "zero": zero.state_dict()}, buffer)
    first = train_step(model, zero, 2)
    first_params = zero.full_parameters()

    model, zero = build()
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    model.load_state_dict(state["model"])
    zero.load_state_dict(state["zero"])
    again = train_step(model, zero, 2)
    again_params = zero.full_parameters()
    same = all(torch.equal(first_params[n], again_params[n]) for n in first_params)
    # A state saved by another stage must be refused with a one-line error.
    fresh = build_model(parity.CFG, seed=parity.SEED)
    other = ZeroOptimizer(fresh, parity.make_optimizer(fresh.parameters()), topo.comm("dp_cp"),
                          1 if stage != 1 else 2, bucket_bytes=SMALL_BUCKET)
    try:
        other.load_state_dict(state["zero"])
        refused = ""
    except ValueError as e:
        refused = str(e)
    return {"first": first, "again": again, "same_params": same, "refused": refused}


def _bf16_case(topo: Topology) -> dict:
    """A bf16 model with 2 micro-batches: DataParallel's fp32 buckets give the exact fp32 average of the bf16 grads."""
    rank, world = topo.coord("dp_cp"), topo.size("dp_cp")
    model = build_model(parity.CFG, seed=parity.SEED).to(torch.bfloat16)
    twin = build_model(parity.CFG, seed=parity.SEED).to(torch.bfloat16)  # same weights, no data parallelism
    dp = DataParallel(model, topo.comm("dp_cp"), bucket_bytes=SMALL_BUCKET)
    inputs, targets = parity.global_batch(0)
    batches = split_batch(inputs, targets, rank, world, 2)
    local = {n: [] for n, _ in twin.named_parameters()}
    for i, (x, y) in enumerate(batches):
        with dp.no_sync() if i == 0 else contextlib.nullcontext():
            (lm_loss(model(x), y) / 2).backward()
        (lm_loss(twin(x), y) / 2).backward()
        for n, p in twin.named_parameters():
            local[n].append(p.grad.clone())
            p.grad = None
    dp.finish_grad_sync()
    out = {"dtypes": {str(p.grad.dtype) for p in model.parameters()} | {str(p.main_grad.dtype)
                                                                         for p in model.parameters()}}
    # The exact answer: every rank's every micro-batch gradient, summed in float64, divided by the group size.
    err_fp32, err_bf16, scale = 0.0, 0.0, 0.0
    for n, p in model.named_parameters():
        mine = torch.stack(local[n])  # [2, ...] bf16
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine, group=topo.group("dp_cp"))
        stacked = torch.cat(everyone)  # [world*2, ...] bf16
        exact = stacked.double().sum(0) / world
        in_bf16 = stacked[0].clone()
        for g in stacked[1:]:  # what a bf16 bucket would do: every partial sum rounded to bf16
            in_bf16 += g
        in_bf16 = in_bf16 / world
        err_fp32 = max(err_fp32, (p.main_grad.double() - exact).abs().max().item())
        err_bf16 = max(err_bf16, (in_bf16.double() - exact).abs().max().item())
        scale = max(scale, exact.abs().max().item())
    out.update(err_fp32=err_fp32, err_bf16=err_bf16, scale=scale)
    return out


def trainer_config(out: str, **changes):
    """A few steps of `minidist.train.loop` on a small model (the same settings for every layout)."""
    from minidist.train.config import TrainConfig

    settings = dict(model="tiny", model_overrides=dict(d_model=64, n_layers=2, d_ff=128), max_bytes=300_000,
                    batch_size=8, seq_len=32, microbatches=2, steps=4, warmup_steps=1, eval_every=0, eval_batches=1,
                    log_every=100, ckpt_every=2, out=out, seed=0, peak_flops=1e12, plot=False)
    return TrainConfig(**{**settings, **changes})


def _trainer_cases(topo: Topology, out_root: str) -> dict:
    """`minidist.train.loop.train` at dp=N for every ZeRO stage; then resume from the step-2 checkpoint and redo 3-4."""
    from minidist.train import checkpoint
    from minidist.train import loop as train

    out = {}
    for stage in range(4):
        root = Path(out_root) / f"zero{stage}"
        first = train.train(trainer_config(str(root), dp=topo.size("dp_cp"), zero=stage))
        # Pretend the run died after the step-2 checkpoint: drop the later one, then resume.
        dist.barrier()
        if dist.get_rank() == 0:
            ckpts = root / "checkpoints"
            shutil.rmtree(ckpts / checkpoint.step_dir_name(4))
            (ckpts / checkpoint.LATEST).write_text(checkpoint.step_dir_name(2) + "\n")
        dist.barrier()
        again = train.train(trainer_config(str(root), dp=topo.size("dp_cp"), zero=stage, resume=True))
        out[stage] = {"losses": first["losses"], "resumed_losses": again["losses"], "hash": first["param_hash"],
                      "resumed_hash": again["param_hash"], "resumed_from": again["resumed_from"]}
    return out


def run_all(world: int, out_root: str) -> dict:
    """The rank function: every case in this process's rank; returns {case name: result}."""
    topo = Topology(ParallelDims(dp=world), dist.get_rank(), dist.get_world_size())
    results = {name: _train(kind, stage, m, topo) for name, (kind, stage, m) in CASES.items()}
    if world == 2:
        results.update({f"checkpoint_zero{s}": _checkpoint_case(s, topo) for s in range(4)})
        results["bf16"] = _bf16_case(topo)
        results["zero2_moe"] = _train("zero", 2, 1, topo, cfg=MOE_CFG)
        results.update({f"zero{s}_m2_no_overlap": _train("zero", s, 2, topo, overlap=False) for s in (2, 3)})
        results["trainer"] = _trainer_cases(topo, out_root)
    return results


@functools.cache
def results(world: int) -> list[dict]:
    """Per-rank results of `run_all(world)` (one launch per world size per test session)."""
    out_root = tempfile.mkdtemp(prefix=f"minidist_dp{world}_")
    try:
        return run_ranks(run_all, world, world, out_root, timeout=300, threads_per_rank=1)
    finally:
        shutil.rmtree(out_root, ignore_errors=True)
