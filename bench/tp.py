"""Tensor-parallel training step: minidist against PyTorch's DTensor tensor parallelism, same model, same ranks.

    .venv/bin/python bench/tp.py [--preset small] [--batch 8] [--seq 128] [--steps 10] [--warmup 2] [--world 2]

Both sides start from the same built `minidist` Transformer (same weights) on `--world` gloo CPU ranks:
- minidist: `apply_tensor_parallel` (and, in an extra row, with sequence parallelism) + `vocab_parallel_cross_entropy`;
- DTensor: `parallelize_module` on a 1-D DeviceMesh with ColwiseParallel for wq/wk/wv/w1/w3, RowwiseParallel for
  wo/w2, the embedding split by vocabulary rows (RowwiseParallel) and the lm_head by vocabulary columns
  (ColwiseParallel, logits left sharded) scored under `loss_parallel()`: the same layout as minidist's.
The first step's losses must agree before anything is timed. A step is forward + loss + backward + AdamW step.
The implementations alternate step by step, so a change in machine load hits all alike; the median is reported
(the slowest rank's time per step: ranks wait for each other in every collective anyway).
Last line: JSON with `ratio` = minidist / DTensor median step time (tensor parallel, no sequence parallel).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.comm.launch import run_ranks
from minidist.comm.topology import ParallelDims, Topology
from minidist.model import build_model, get_preset
from minidist.parallel.tp.tensor import apply_tensor_parallel
from minidist.parallel.tp.vocab import vocab_parallel_cross_entropy


def dtensor_model(model: torch.nn.Module, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan |= {f"{b}.attn.wq": ColwiseParallel(), f"{b}.attn.wk": ColwiseParallel(),
                 f"{b}.attn.wv": ColwiseParallel(), f"{b}.attn.wo": RowwiseParallel(),
                 f"{b}.mlp.w1": ColwiseParallel(), f"{b}.mlp.w3": ColwiseParallel(), f"{b}.mlp.w2": RowwiseParallel()}
    return parallelize_module(model, mesh, plan)


def dtensor_loss(logits, targets: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def dtensor_backward(loss: torch.Tensor) -> None:
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():  # the backward of the parallel loss must run inside the context too
        loss.backward()


def rank_step_times(preset: str, batch: int, seq: int, steps: int, warmup: int) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = get_preset(preset)
    comm = Topology(ParallelDims(tp=world), rank, world).comm("tp")
    plain = build_model(cfg, seed=0)
    models = {
        "minidist tp": apply_tensor_parallel(copy.deepcopy(plain), cfg, comm),
        "minidist tp+sp": apply_tensor_parallel(copy.deepcopy(plain), cfg, comm, sequence_parallel=True),
        "dtensor tp": dtensor_model(copy.deepcopy(plain), world),
    }
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False) for name, m in models.items()}
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)

    def step(name: str) -> float:
        model, optimizer = models[name], optimizers[name]
        if name.startswith("dtensor"):
            loss = dtensor_loss(model(inputs), targets)
            dtensor_backward(loss)
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        else:
            loss = vocab_parallel_cross_entropy(model(inputs), targets, comm)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    first = {name: step(name) for name in models}
    want = F.cross_entropy(plain(inputs).flatten(0, 1), targets.flatten()).item()
    for name, value in first.items():
        if abs(value - want) > 1e-4 * abs(want):
            raise AssertionError(f"{name}: first loss {value} differs from the single-device {want}")
    times = {name: [] for name in models}
    for i in range(warmup - 1 + steps):
        for name in models:
            dist.barrier()
            start = time.perf_counter()
            step(name)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            if i >= warmup - 1:
                times[name].append(elapsed.item())
    return {"first_loss": first, "single_device_loss": want, "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()

    # run_ranks needs an importable function: import this file as a module (its folder is on sys.path).
    me = importlib.import_module(Path(__file__).stem)
    start = time.perf_counter()
    out = run_ranks(me.rank_step_times, args.world, args.preset, args.batch, args.seq, args.steps, args.warmup,
                    timeout=1200)[0]
    medians = {name: statistics.median(t) for name, t in out["times"].items()}
    print(f"{args.preset}, batch {args.batch} x seq {args.seq}, tp={args.world} gloo CPU ranks, "
          f"{args.steps} timed steps each (alternating), first loss {out['single_device_loss']:.4f} everywhere")
    print(f"{'implementation':<18}{'median step (ms)':>18}{'min (ms)':>12}{'vs dtensor':>12}")
    for name, median in medians.items():
        print(f"{name:<18}{1e3 * median:>18.1f}{1e3 * min(out['times'][name]):>12.1f}"
              f"{median / medians['dtensor tp']:>12.3f}")
    print(json.dumps({"ratio": round(medians["minidist tp"] / medians["dtensor tp"], 4),
                      "ratio_sp": round(medians["minidist tp+sp"] / medians["dtensor tp"], 4),
                      "minidist_ms": round(1e3 * medians["minidist tp"], 2),
                      "minidist_sp_ms": round(1e3 * medians["minidist tp+sp"], 2),
                      "dtensor_ms": round(1e3 * medians["dtensor tp"], 2),
                      "preset": args.preset, "batch": args.batch, "seq": args.seq, "world": args.world,
                      "steps": args.steps, "wall_s": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
