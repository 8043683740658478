"""Data-parallel training steps: minidist against PyTorch's DistributedDataParallel and FSDP2 (`fully_shard`).

    .venv/bin/python bench/dp.py [--preset small] [--world 2] [--batch 8] [--seq 128] [--steps 8] [--warmup 2]

Same model (the preset, same initial weights), same world size, gloo on CPU, the same global batch of every step,
AdamW with global-norm clipping. Variants:

    minidist_zero0   minidist.parallel.ZeroOptimizer(stage=0): bucketed all-reduce overlapped with backward
    ddp              torch.nn.parallel.DistributedDataParallel
    minidist_zero3   minidist.parallel.ZeroOptimizer(stage=3): parameters sharded, gathered per block
    fsdp2            torch.distributed.fsdp.fully_shard on every block, then on the model
    minidist_zero1, minidist_zero2  (for the table)

Timing: one launch; the variants take turns step by step (a change in machine load hits all alike); each rank
reports its step times and a step's time is the slowest rank's. Memory: one short launch per variant, sampling the
resident set size (RSS) of every rank during a few steps; reported as the peak above the RSS the rank had before
building the model (MiB, max over ranks), next to the model-state bytes the rank holds (parameters, gradients,
optimizer state, counted from tensor storages). RSS also counts activations and allocator caching, so it is
an upper bound for the states.

Last line: JSON with the median step times, the peaks, and the ratios
{"ratio_vs_ddp": minidist_zero0 / ddp, "ratio_vs_fsdp2": minidist_zero3 / fsdp2} (median step time).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import os
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.comm.launch import run_ranks
from minidist.comm.topology import ParallelDims, Topology
from minidist.data.corpus import load_corpus
from minidist.data.sampler import BatchSampler
from minidist.memory import storage_bytes
from minidist.model import build_model, get_preset, lm_loss
from minidist.parallel import ZeroOptimizer, split_batch

VARIANTS = ("minidist_zero0", "ddp", "minidist_zero3", "fsdp2", "minidist_zero1", "minidist_zero2")
LR, CLIP = 1e-3, 1.0


def _malloc_returns_memory() -> None:
    """Make glibc serve allocations of 64 KiB and more with mmap, so that freed tensors leave the RSS at once.

    By default glibc raises its mmap threshold after large frees and keeps the freed pages in its heap: the RSS then
    remembers old allocations, and a peak would measure allocator history rather than what a variant holds.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD (fixed: no dynamic adjustment)
        libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD
    except OSError:  # not glibc: RSS peaks include cached pages
        pass


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRSS:
    """Samples this process's RSS every millisecond in a background thread; `.peak` is the highest seen."""

    def __init__(self) -> None:
        self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes())
            time.sleep(0.001)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss_bytes())


class _Variant:
    """One way of training the same model: build it, then `step(batches)` does forward, backward, clip, update."""

    def __init__(self, name: str, preset: str, topo: Topology) -> None:
        self.name = name
        cfg = get_preset(preset)
        model = build_model(cfg, seed=0)
        self.numel = sum(p.numel() for p in model.parameters())
        world = topo.size("dp_cp")
        self.zero = None
        if name.startswith("minidist_zero"):
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
            self.zero = ZeroOptimizer(model, optimizer, topo.comm("dp_cp"), int(name[-1]))
            self.optimizer = self.zero
        elif name == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
        elif name == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
        else:
            raise ValueError(f"unknown variant {name!r}; choose from {VARIANTS}")
        self.model = model

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]], before_zero_grad=None) -> float:
        start = time.perf_counter()
        for x, y in batches:
            (lm_loss(self.model(x), y) / len(batches)).backward()
        if self.zero is not None:
            self.zero.clip_grad_norm(CLIP)
        else:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        if before_zero_grad is not None:
            before_zero_grad()
        self.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    def measure_states(self) -> None:
        """Parameters, gradients and optimizer state this rank holds after the update (DTensor: its local shard).

        DDP's own gradient buckets are invisible from here (not referenced by any parameter): add 4 bytes/param.
        """
        self.states = self._state_bytes()

    def _state_bytes(self) -> int:
        if self.zero is not None:
            return sum(self.zero.memory_bytes().values())
        local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
        tensors = [local(p.data) for p in self.model.parameters()]
        tensors += [local(p.grad) for p in self.model.parameters() if p.grad is not None]
        tensors += [local(v) for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return storage_bytes(tensors)


def _batches(sampler: BatchSampler, step: int, rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    inputs, targets = sampler.batch(step)
    return split_batch(inputs, targets, rank, world)


def _sampler(batch: int, seq: int) -> BatchSampler:
    return BatchSampler(load_corpus(max_bytes=2_000_000).train, seq, batch, seed=0)


def rank_step_times(preset: str, batch: int, seq: int, steps: int, warmup: int, variants: list[str]) -> dict:
    """All variants in one process, taking turns step by step; returns each variant's step times."""
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology(ParallelDims(dp=world), rank, world)
    runs = [_Variant(name, preset, topo) for name in variants]
    sampler = _sampler(batch, seq)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for step in range(warmup + steps):
        batches = _batches(sampler, step, rank, world)
        for run in runs:
            dist.barrier()  # every variant's step starts together on all ranks
            elapsed = run.step(batches)
            if step >= warmup:
                times[run.name].append(elapsed)
    return times


def rank_memory(preset: str, batch: int, seq: int, steps: int, variant: str) -> dict:
    """Peak RSS above the pre-model baseline during `steps` steps of one variant, and its model-state bytes."""
    _malloc_returns_memory()
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology(ParallelDims(dp=world), rank, world)
    sampler = _sampler(batch, seq)
    batches = [_batches(sampler, step, rank, world) for step in range(steps)]
    baseline = _rss_bytes()
    monitor = _PeakRSS()
    run = _Variant(variant, preset, topo)
    for b in batches:
        run.step(b, before_zero_grad=run.measure_states)
    states = run.states
    return {"peak_rss": monitor.stop() - baseline, "state_bytes": states, "numel": run.numel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="small", help="model preset (default: small)")
    parser.add_argument("--world", type=int, default=2, help="data-parallel ranks (default: 2)")
    parser.add_argument("--batch", type=int, default=8, help="global batch in sequences (default: 8)")
    parser.add_argument("--seq", type=int, default=128, help="sequence length (default: 128)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per variant (default: 8)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first (default: 2)")
    parser.add_argument("--memory-steps", type=int, default=3, help="steps per memory launch (default: 3)")
    args = parser.parse_args()

    # run_ranks needs an importable function: import this file as a module (its folder is on sys.path).
    bench_module = importlib.import_module(Path(__file__).stem)
    variants = list(VARIANTS)
    started = time.perf_counter()
    per_rank = run_ranks(bench_module.rank_step_times, args.world, args.preset, args.batch, args.seq, args.steps,
                         args.warmup, variants, timeout=1800)
    # A data-parallel step is as slow as its slowest rank.
    step_times = {v: [max(r[v][i] for r in per_rank) for i in range(args.steps)] for v in variants}
    median = {v: statistics.median(t) for v, t in step_times.items()}
    memory = {}
    for v in variants:
        out = run_ranks(bench_module.rank_memory, args.world, args.preset, args.batch, args.seq, args.memory_steps, v,
                        timeout=900)
        memory[v] = {"peak_rss_mib": max(o["peak_rss"] for o in out) / 2**20,
                     "state_mib": max(o["state_bytes"] for o in out) / 2**20, "numel": out[0]["numel"]}

    numel = memory[variants[0]]["numel"]
    print(f"{args.preset}: {numel / 1e6:.2f}M parameters, world {args.world} (gloo, CPU, "
          f"{torch.get_num_threads()} threads here, 1 per rank), global batch {args.batch} x {args.seq}, "
          f"{args.steps} timed steps after {args.warmup} warm-up, variants interleaved")
    print(f"{'variant':<16}{'median s':>10}{'min s':>9}{'max s':>9}{'peak RSS MiB':>14}{'states MiB':>12}")
    for v in variants:
        t = step_times[v]
        print(f"{v:<16}{median[v]:>10.3f}{min(t):>9.3f}{max(t):>9.3f}{memory[v]['peak_rss_mib']:>14.1f}"
              f"{memory[v]['state_mib']:>12.1f}")
    result = {
        "ratio_vs_ddp": median["minidist_zero0"] / median["ddp"],
        "ratio_vs_fsdp2": median["minidist_zero3"] / median["fsdp2"],
        "median_step_s": median,
        "peak_rss_mib": {v: memory[v]["peak_rss_mib"] for v in variants},
        "state_mib": {v: memory[v]["state_mib"] for v in variants},
        "preset": args.preset, "world": args.world, "batch": args.batch, "seq": args.seq,
        "wall_s": time.perf_counter() - started,
    }
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else
                          {kk: round(vv, 4) for kk, vv in v.items()} if isinstance(v, dict) else v)
                      for k, v in result.items()}))


if __name__ == "__main__":
    main()
