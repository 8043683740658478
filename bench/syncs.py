"""Host reads, blocking copies, stream syncs, data-sized operators and aten operators per training step, by layout,
counted on the CPU.

    .venv/bin/python bench/syncs.py [--steps 8] [--log-every 4] [--no-ops]

A read of a tensor's value on the host (`.item()`, `.tolist()`, `float(t)`, `if t:`, `.cpu()`, ...) stops a GPU's
host until every queued kernel has run; on a CPU it costs nothing, so this counts them instead of timing them
(`minidist.debug.host_reads`: only reads made by minidist's own code). Each layout trains the tiny model through
`minidist.train.train` for --steps steps, logging every --log-every steps, with no evaluation and no checkpoint
before the end; a step's count runs from where the trainer fetches its batches to where it fetches the next.
Logging steps (the first, every --log-every-th, the last: they also write metrics, check replicas at the end and
checkpoint) are reported apart from the others: "reads" and "ops" are the most over the non-logging steps, rank 0;
"log reads" the most over the logging steps after the first (the first also pays one-time costs).
The aten count leaves out views (no kernel) and runs under a dispatch mode (slower: counts only, no times). On a
CPU the non-finite guard (`minidist.parallel.skip_step`) reads its flag once per step (the unfused AdamW cannot take
it on the device; a CPU read waits for nothing): 1 read; CUDA's fused AdamW takes it as found_inf, with no read.

Beside the reads (`minidist.debug.host_reads`): "copies", the package's `.to(device)` calls without non_blocking
that copy (or whose source lives on the host on any machine: the sampler's rows), each a stream sync on CUDA
(pinned memory with non_blocking is none); "syncs", stream and device synchronizations (torch.cuda's, and the
trainer's own `metrics.synchronize`, a no-op here); "shape", aten operators whose output size depends on tensor
values (nonzero, boolean indexing, repeat_interleave without output_size, ...: a host read of a size on CUDA,
whoever calls it; counted with the operators, so not under --no-ops). Each is the most over the non-logging steps.

Last line: JSON {layout: {"reads": .., "log_reads": .., "copies": .., "syncs": .., "shape": .., "ops": ..,
"sites": {site: count on a non-logging step}}}.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import tempfile
import warnings
from pathlib import Path

import torch

from minidist.comm.launch import run_ranks
from minidist.debug.host_reads import count_run
from minidist.train.config import TrainConfig

DENSE = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "max_seq_len": 64}
MOE = {**DENSE, "moe": {"n_experts": 4, "top_k": 2, "bias_update_speed": 0.05, "capacity_factor": 1.0}}

# name: (world size, model, layout settings)
LAYOUTS = {
    "dense 1 process": (1, DENSE, {}),
    "dense dp2 zero1": (2, DENSE, dict(dp=2, zero=1)),
    "dense tp2 sp": (2, DENSE, dict(tp=2, sp=True)),
    "dense dp2 zero3": (2, DENSE, dict(dp=2, zero=3)),
    "dense pp2": (2, DENSE, dict(pp=2)),
    "dense cp2 ring": (2, DENSE, dict(cp=2)),
    "dense cp2 allgather": (2, DENSE, dict(cp=2, cp_impl="allgather")),
    "moe 1 process": (1, MOE, {}),
    "moe dp2 ep2": (2, MOE, dict(dp=2, ep=2)),
}


def config(out: str, model: dict, steps: int, log_every: int, **layout) -> TrainConfig:
    return TrainConfig(model="tiny", model_overrides=dict(model), max_bytes=100_000, batch_size=8, seq_len=32,
                       microbatches=2, steps=steps, warmup_steps=1, grad_clip=1.0, eval_every=0, check_every=0,
                       ckpt_every=0, log_every=log_every, out=out, seed=0, peak_flops=1e12, plot=False, **layout)


def rank_counts(out: str, model: dict, steps: int, log_every: int, ops: bool, layout: dict) -> dict:
    """On every rank: one run of the layout, counted."""
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 on the 2.11 names the package uses
    with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):  # the trainer's progress lines
        return count_run(config(out, model, steps, log_every, **layout), ops=ops)


def summarize(counts: dict) -> dict:
    logging = set(counts["logging"])
    quiet = [s for s in counts["reads"] if s not in logging]
    worst = max(quiet, key=lambda s: counts["reads"][s]) if quiet else None
    return {"reads": max((counts["reads"][s] for s in quiet), default=0),
            "log_reads": max((counts["reads"][s] for s in logging if s > 0), default=0),
            "ops": max((counts["ops"][s] for s in quiet), default=0),
            **{kind: max((counts[kind][s] for s in quiet), default=0) for kind in ("copies", "syncs", "shape")},
            "log_ops": max((counts["ops"][s] for s in logging if s > 0), default=0),
            "sites": counts["sites"][worst] if worst is not None else {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--log-every", type=int, default=4)
    parser.add_argument("--no-ops", action="store_true", help="count host reads only (faster)")
    args = parser.parse_args()
    # run_ranks needs an importable function: import this file as a module (its folder is on sys.path).
    bench_module = importlib.import_module(Path(__file__).stem)
    results = {}
    print(f"torch {torch.__version__}; {args.steps} steps, logging every {args.log_every} (and the first, the last)")
    print(f"{'layout':<18} {'reads/step':>10} {'log step':>9} {'copies':>7} {'syncs':>6} {'shape':>6} "
          f"{'aten ops/step':>14} {'log step':>9}")
    with tempfile.TemporaryDirectory() as root:
        for name, (world, model, layout) in LAYOUTS.items():
            out = str(Path(root) / name.replace(" ", "_"))
            run = (out, model, args.steps, args.log_every, not args.no_ops, layout)
            if world > 1:
                counts = run_ranks(bench_module.rank_counts, world, *run, timeout=600)[0]
            else:
                counts = rank_counts(*run)
            results[name] = summary = summarize(counts)
            shape = summary["shape"] if not args.no_ops else "-"
            print(f"{name:<18} {summary['reads']:>10} {summary['log_reads']:>9} {summary['copies']:>7} "
                  f"{summary['syncs']:>6} {shape:>6} {summary['ops']:>14} {summary['log_ops']:>9}")
            for site, n in sorted(summary["sites"].items()):
                print(f"    {n:>3}  {site}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
