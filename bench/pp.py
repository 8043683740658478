"""Pipeline-parallel step time: minidist's executor against `torch.distributed.pipelining`, same model, same stages.

    .venv/bin/python bench/pp.py [--pp 2] [--microbatches 4] [--d-model 128] [--layers 4] [--batch 16] [--seq 64]
                                 [--steps 15] [--warmup 3] [--schedules afab,1f1b,interleaved,zbv,dualpipev]

On `--pp` gloo CPU ranks both sides cut one built minidist Transformer (same weights) into the same chunks: rank r
holds chunk r (and r+p with 2 virtual stages, interleaved; r and 2p−1−r under the V of zbv and dualpipev).
minidist runs `PipelineRunner`; torch runs a `PipelineStage` per chunk under ScheduleGPipe / Schedule1F1B /
ScheduleInterleaved1F1B / ScheduleZBVZeroBubble / ScheduleDualPipeV with `lm_loss` as its loss, on the same
micro-batches (zbv and dualpipev need --microbatches >= 2·pp). On one CPU core per rank DualPipeV's F/B overlap
cannot show: torch runs its overlapped sub-actions one after another, as minidist runs its (F, B) pairs.
The first step's gradients must agree (per parameter name) before anything is timed. A
step is forward + backward of all micro-batches (no optimizer: it would be the same on both sides and only dilute
the difference). The implementations alternate step by step after a barrier, so a change in machine load hits
both alike; a step's time is the slowest rank's. Last line: JSON with `ratio` = the geometric mean over the
schedules of minidist median / torch median, each schedule's ratio in `ratios`, and the largest in `ratio_max`;
per schedule also `paired_ratio_<schedule>`, the median of the per-step ratios of the alternating pairs (e.g.
`paired_ratio_zbv` and `paired_ratio_dualpipev`, chapter 15).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from minidist.comm.launch import run_ranks
from minidist.comm.topology import ParallelDims, Topology
from minidist.model import Transformer, build_model, get_preset, lm_loss
from minidist.parallel.pp.pipeline import PipelineRunner, partition_model

TORCH_SCHEDULES = {"afab": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zbv": "ScheduleZBVZeroBubble",  # zbv, dualpipev: two chunks per rank in a V (chapter 15)
                   "dualpipev": "ScheduleDualPipeV"}


class TorchChunk(nn.Module):
    """One chunk of the model for torch's PipelineStage: tensor in, tensor out (logits on the last chunk). Chunk c
    of p·v chunks is stage c of the model cut into p·v stages; the model's own forward runs it."""

    def __init__(self, model: Transformer, chunk: int, n_chunks: int) -> None:
        super().__init__()
        self.part = partition_model(model, chunk, n_chunks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.part.forward_chunk(self.part.pp_rank, x)


def _setups(schedule: str, topo: Topology, cfg, m: int, inputs: torch.Tensor, targets: torch.Tensor):
    """(minidist step, torch step, the modules holding each side's parameters) for one schedule on this rank."""
    from torch.distributed import pipelining

    pp, rank = topo.size("pp"), topo.coord("pp")
    v = 2 if schedule in ("interleaved", "zbv", "dualpipev") else 1
    stage = partition_model(build_model(cfg, seed=0), rank, pp, v if schedule == "interleaved" else 1,
                            schedule=schedule)
    runner = PipelineRunner(stage, topo.comm("pp"), schedule, m)
    batches = list(zip(inputs.chunk(m), targets.chunk(m)))
    torch_model = build_model(cfg, seed=0)
    chunks = nn.ModuleList(TorchChunk(torch_model, c, pp * v) for c in stage.chunks)
    stages = [pipelining.PipelineStage(c, i, pp * v, torch.device("cpu"), group=topo.group("pp"))
              for c, i in zip(chunks, stage.chunks)]
    torch_schedule = getattr(pipelining, TORCH_SCHEDULES[schedule])(stages if v > 1 else stages[0], m,
                                                                    loss_fn=lm_loss)

    def ours() -> None:
        runner.step(batches, loss_scale=1.0 / targets.numel())  # Σ token losses / tokens: no target is ignored

    def theirs() -> None:
        args = (inputs,) if 0 in stage.chunks else ()  # under the V rank 0 holds the first and the last chunk
        kwargs = {"target": targets, "losses": []} if pp * v - 1 in stage.chunks else {}
        torch_schedule.step(*args, **kwargs)

    return ours, theirs, stage, chunks


def rank_step_times(schedules: list[str], pp: int, m: int, d_model: int, layers: int, batch: int, seq: int,
                    steps: int, warmup: int) -> dict:
    topo = Topology(ParallelDims(pp=pp), dist.get_rank(), dist.get_world_size())
    cfg = get_preset("tiny", d_model=d_model, n_layers=layers, n_heads=4, n_kv_heads=2, d_ff=3 * d_model,
                     max_seq_len=seq)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=generator)
    times: dict[str, list[float]] = {}
    for schedule in schedules:
        ours, theirs, stage, chunks = _setups(schedule, topo, cfg, m, inputs, targets)
        ours()
        theirs()
        mine = dict(stage.named_parameters())
        for name, param in chunks.named_parameters():  # same gradients, by name, before anything is timed
            name = name.split(".", 2)[2]  # drop the ModuleList index and "part"
            if not torch.allclose(param.grad, mine[name].grad, rtol=1e-4, atol=1e-6):
                raise AssertionError(f"{schedule}: gradient of {name} differs between minidist and torch")
        sides = (("minidist", ours, stage), ("torch", theirs, chunks))
        for i in range(warmup + steps):
            for side, run, model in sides:
                model.zero_grad(set_to_none=True)
                dist.barrier()
                start = time.perf_counter()
                run()
                elapsed = time.perf_counter() - start
                if i >= warmup:
                    times.setdefault(f"{schedule} {side}", []).append(elapsed)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--schedules", default="afab,1f1b,interleaved")
    args = parser.parse_args()
    schedules = args.schedules.split(",")
    for s in schedules:
        if s not in TORCH_SCHEDULES:
            parser.error(f"unknown schedule {s!r}; choose from {sorted(TORCH_SCHEDULES)}")

    # run_ranks needs an importable function: import this file as a module (its folder is on sys.path).
    me = importlib.import_module(Path(__file__).stem)
    start = time.perf_counter()
    per_rank = run_ranks(me.rank_step_times, args.pp, schedules, args.pp, args.microbatches, args.d_model,
                         args.layers, args.batch, args.seq, args.steps, args.warmup, timeout=1200)
    # A step takes as long as its slowest rank.
    times = {k: [max(r[k][i] for r in per_rank) for i in range(args.steps)] for k in per_rank[0]}
    medians = {k: statistics.median(t) for k, t in times.items()}
    print(f"pp={args.pp} gloo CPU ranks, {args.microbatches} micro-batches of {args.batch // args.microbatches} x "
          f"seq {args.seq}, d_model {args.d_model}, {args.layers} layers, {args.steps} timed steps each (alternating)")
    print(f"{'schedule':<14}{'minidist (ms)':>15}{'torch (ms)':>13}{'ratio':>9}")
    ratios = {}
    for s in schedules:
        ours, theirs = medians[f"{s} minidist"], medians[f"{s} torch"]
        ratios[s] = round(ours / theirs, 4)
        print(f"{s:<14}{1e3 * ours:>15.1f}{1e3 * theirs:>13.1f}{ours / theirs:>9.3f}")
    geomean = math.prod(ratios.values()) ** (1 / len(ratios))
    paired = {f"paired_ratio_{s}": round(statistics.median(a / b for a, b in zip(times[f"{s} minidist"],
                                                                                  times[f"{s} torch"])), 4)
              for s in schedules}
    print(json.dumps({"ratio": round(geomean, 4), "ratios": ratios, "ratio_max": max(ratios.values()), **paired,
                      "minidist_ms": {s: round(1e3 * medians[f"{s} minidist"], 2) for s in schedules},
                      "torch_ms": {s: round(1e3 * medians[f"{s} torch"], 2) for s in schedules},
                      "pp": args.pp, "microbatches": args.microbatches, "batch": args.batch, "seq": args.seq,
                      "d_model": args.d_model, "layers": args.layers, "steps": args.steps,
                      "wall_s": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
