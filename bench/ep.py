"""An MoE training step with the experts sharded by expert parallelism, against the same model with every expert
replicated on every rank (plain data parallelism of the MoE).

    .venv/bin/python bench/ep.py [--size base|small] [--world 2] [--batch 16] [--seq 128] [--steps 30] [--warmup 60]

Same model (same initial weights), same global batch of every step, gloo on CPU, both through
`minidist.parallel.assembly`:

    replicated   dp=world: every rank holds all N experts; expert gradients are all-reduced with the rest
    ep           dp=world, ep=world: every rank holds N/ep experts; tokens travel to them by all-to-all and back,
                 expert gradients are reduced over edp (size dp/ep: here 1, nothing to send)

Timing: one launch; the two variants take turns step by step (a change in machine load hits both alike); a step's
time is the slowest rank's (a collective waits for it). The untimed warm-up steps train with the balance loss and
the aux-free bias first: at initialization a byte-level model's router sends the frequent bytes to the same few
experts, and EP then measures that imbalance (the most loaded rank computes for everyone), not its own cost. The
load per rank (expert rows computed, max/mean over the ep ranks, per layer: each layer's combine waits for its
busiest rank) is reported. Memory: the bytes of the tensors a rank holds (parameters and AdamW's two moments,
counted from their storages), split into expert weights and the rest.

Last line: JSON with `ratio` = the median over the timed steps of (EP step time / replicated step time),
`memory_ratio` = EP per-rank parameter + optimizer bytes / replicated, and `expert_memory_ratio` (expert weights
and their moments only: 1/ep when the experts split evenly).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.comm.launch import run_ranks
from minidist.comm.topology import ParallelDims, Topology
from minidist.data.corpus import load_corpus
from minidist.data.sampler import BatchSampler
from minidist.memory import storage_bytes
from minidist.model import build_model, get_preset
from minidist.model.moe.stats import moe_layers
from minidist.parallel import ParallelOptions, parallelize
from minidist.train.optim import build_optimizer

VARIANTS = ("replicated", "ep")
# "small": experts so narrow that each MoE layer's few blocking collectives (~1 ms each on a shared 2-core VM)
# and its busiest rank's extra rows are a visible part of the step; "base": experts twice as wide, where the
# expert compute (and the expert-gradient all-reduce that EP avoids) dominates, as in real MoE models.
SIZES = {"small": dict(d_model=128, d_ff=256, d_expert=256), "base": dict(d_model=256, d_ff=512, d_expert=512)}


def model_config(size: str) -> dict:
    width = SIZES[size]
    return dict(d_model=width["d_model"], n_layers=4, n_heads=4, n_kv_heads=2, d_ff=width["d_ff"], max_seq_len=256,
                moe=dict(n_experts=8, top_k=2, d_expert=width["d_expert"], aux_loss_coef=0.01,
                         bias_update_speed=0.01))


def _state_bytes(parallel) -> dict[str, int]:
    """Bytes of parameters and optimizer moments, for expert weights and for the rest."""
    experts = {id(p) for layer in moe_layers(parallel.model) for p in layer.experts.parameters()}
    out = {}
    for kind, wanted in (("expert", True), ("dense", False)):
        params = [p for p in parallel.model.parameters() if (id(p) in experts) == wanted]
        ids = {id(p) for p in params}
        moments = [v for p, s in parallel.optimizer.state.items() if id(p) in ids
                   for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
        out[kind] = storage_bytes(params) + storage_bytes(moments)
    return out


def rank_run(size: str, batch: int, seq: int, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = get_preset("tiny", **model_config(size))
    sampler = BatchSampler(load_corpus(max_bytes=1_000_000).train, seq, batch, seed=0)
    make_optimizer = lambda model: build_optimizer(model, lr=1e-3, weight_decay=0.1)  # noqa: E731
    models = {}
    for name, ep in (("replicated", 1), ("ep", world)):
        topo = Topology(ParallelDims(dp=world, ep=ep), rank, world)
        models[name] = parallelize(build_model(cfg, seed=0), cfg, topo, ParallelOptions(), make_optimizer)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    losses: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rank_loads = []  # per timed step: max / mean over ep ranks of the expert rows each computed, mean over layers
    quiet = Topology(ParallelDims(dp=world, ep=world), rank, world).comm("ep")
    for step in range(warmup + steps):
        inputs, targets = sampler.shard(step, rank, world)
        for name in VARIANTS:
            parallel = models[name]
            dist.barrier()
            start = time.perf_counter()
            loss = parallel.forward_backward([(inputs, targets)]).loss
            parallel.clip_grad_norm_(1.0)
            parallel.step()
            elapsed = time.perf_counter() - start
            losses[name].append(loss)
            if step >= warmup:
                times[name].append(elapsed)
        if step >= warmup:  # count matrix [ep, N] of each layer: rank r computes the rows of its experts' columns
            loads = []
            for m in moe_layers(models["ep"].model):  # per layer: its combine waits for the busiest rank
                rows = quiet.all_gather(m.experts.last_counts[None]).view(world, world, -1).sum(dim=(0, 2)).double()
                loads.append((rows.max() / rows.mean()).item())
            rank_loads.append(statistics.mean(loads))
    return {"times": times, "losses": losses, "bytes": {v: _state_bytes(models[v]) for v in VARIANTS},
            "rank_load": statistics.median(rank_loads)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="base",
                        help="expert width: base (d_model 256, d_expert 512) or small (128, 256) (default: base)")
    parser.add_argument("--world", type=int, default=2, help="ranks: dp = ep = world (default: 2)")
    parser.add_argument("--batch", type=int, default=16, help="global batch in sequences (default: 16)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (default: 128)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per variant (default: 30)")
    parser.add_argument("--warmup", type=int, default=60, help="untimed steps per variant first (default: 60)")
    args = parser.parse_args()

    # run_ranks needs an importable function: import this file as a module (its folder is on sys.path).
    bench_module = importlib.import_module(Path(__file__).stem)
    started = time.perf_counter()
    per_rank = run_ranks(bench_module.rank_run, args.world, args.size, args.batch, args.seq, args.steps, args.warmup,
                         timeout=1800)
    step_times = {v: [max(r["times"][v][i] for r in per_rank) for i in range(args.steps)] for v in VARIANTS}
    median = {v: statistics.median(t) for v, t in step_times.items()}
    # The ratio of each step's pair (run back to back), then the median: a drift of the machine's speed over the
    # run cancels inside a pair.
    paired = statistics.median(e / r for e, r in zip(step_times["ep"], step_times["replicated"]))
    # Every rank holds the same number of experts, so rank 0's bytes are every rank's.
    held = {v: per_rank[0]["bytes"][v] for v in VARIANTS}
    total = {v: held[v]["expert"] + held[v]["dense"] for v in VARIANTS}
    # Parity: the same losses step by step. Over many steps tiny rounding differences (another summation order of
    # the expert gradients) grow, and the aux-free bias's sign rule amplifies them: compare the first 10 steps.
    first = list(zip(per_rank[0]["losses"]["ep"], per_rank[0]["losses"]["replicated"]))[:10]
    gap = max(abs(a - b) for a, b in first)

    model = model_config(args.size)
    e = model["moe"]
    print(f"MoE ({args.size}): {model['n_layers']} layers, d_model {model['d_model']}, {e['n_experts']} experts of "
          f"d_expert {e['d_expert']}, top-{e['top_k']}; world {args.world} (gloo, CPU, 1 thread per rank), global "
          f"batch {args.batch} x {args.seq}, {args.steps} timed steps after {args.warmup} warm-up, interleaved")
    print(f"{'variant':<12}{'median s':>10}{'min s':>9}{'max s':>9}{'expert MiB':>12}{'dense MiB':>11}"
          f"{'total MiB':>11}")
    for v in VARIANTS:
        t = step_times[v]
        print(f"{v:<12}{median[v]:>10.3f}{min(t):>9.3f}{max(t):>9.3f}{held[v]['expert'] / 2**20:>12.2f}"
              f"{held[v]['dense'] / 2**20:>11.2f}{total[v] / 2**20:>11.2f}")
    print(f"largest loss difference between the variants over the first {len(first)} steps: {gap:.2e}; load of the "
          f"most loaded ep rank / mean (per layer, mean over layers, median over the timed steps): "
          f"{per_rank[0]['rank_load']:.3f}; EP / replicated, median of the per-step ratios: {paired:.3f}")
    result = {
        "ratio": paired,
        "memory_ratio": total["ep"] / total["replicated"],
        "expert_memory_ratio": held["ep"]["expert"] / held["replicated"]["expert"],
        "median_step_s": median, "bytes_per_rank": total, "loss_gap_first_10_steps": f"{gap:.1e}",
        "rank_load": per_rank[0]["rank_load"],
        "size": args.size, "world": args.world, "batch": args.batch, "seq": args.seq,
        "wall_s": time.perf_counter() - started,
    }
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else
                          {kk: round(vv, 4) for kk, vv in v.items()} if isinstance(v, dict) else v)
                      for k, v in result.items()}))


if __name__ == "__main__":
    main()
