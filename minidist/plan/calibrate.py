"""The planner on the machine at hand (chapter 12): its cost model calibrated with measured CPU figures, and the
measured step times of layouts to rank its predictions against.

* `measure_machine` (a rank function): this rank's matmul peak (`flops.measure_matmul_peak`, with the thread count
  each rank really has) and gloo all-reduce timings over the world, fitted to α and β
  (`cost_model.fit_alpha_beta`, chapter 00);
* `cpu_cluster`: a `cluster.Cluster` from those figures, every rank "inside one node" (one machine);
* `time_layouts` (a rank function): the fastest of a few steps of each layout through `parallelize`;
* `spearman`: Spearman's rank correlation of predicted and measured times (Spearman 1904), ties averaged.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from minidist.comm.communicator import Comm
from minidist.comm.cost_model import fit_alpha_beta
from minidist.flops import measure_matmul_peak, model_matmul_shapes
from minidist.hardware import Link
from minidist.model import ModelConfig
from minidist.parallel import Layout
from minidist.plan.cluster import Cluster
from minidist.plan.memory_measure import build_case, random_batch


def measure_machine(cfg: ModelConfig, tokens: int, sizes: Sequence[int] = (2**10, 2**14, 2**18, 2**21),
                    repeats: int = 5, min_seconds: float = 0.5) -> dict:
    """Rank function: {"peak": this rank's best fp32 matmul FLOP/s over square shapes and the model's own for
    `tokens` tokens, "alpha", "beta": the α-β fit of all-reduces of `sizes` bytes over the world (best of
    `repeats` each), "samples": the timings}."""
    shapes = [(s, s, s) for s in (256, 512)] + model_matmul_shapes(cfg, tokens)
    peak, _ = measure_matmul_peak(shapes, torch.float32, "cpu", min_seconds)
    comm, best = Comm(), []  # the world
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        seconds = float("inf")
        for _ in range(repeats + 1):  # the first is a warm-up
            comm.barrier()
            start = time.perf_counter()
            comm.all_reduce(x)
            seconds = min(seconds, time.perf_counter() - start)
        best.append(seconds)
    # every rank takes rank 0's timings, so all of them fit the same α and β
    shared = comm.broadcast(torch.tensor(best, dtype=torch.float64), src=0)
    samples = [("all_reduce", float(nbytes), comm.size, t) for nbytes, t in zip(sizes, shared.tolist())]
    alpha, beta = fit_alpha_beta(samples)
    return {"peak": peak, "alpha": alpha, "beta": beta, "samples": samples}


def cpu_cluster(peak: float, alpha: float, beta: float, ranks: int, efficiency: float = 1.0,
                memory_bytes: float = 2**40) -> Cluster:
    """This machine as the planner's cluster: `ranks` processes in one "node" joined by the fitted gloo link."""
    link = Link("gloo on this machine (fitted)", 1.0 / beta if beta > 0 else float("inf"), alpha)
    return Cluster("cpu", peak, memory_bytes, ranks, link, link, efficiency, usable_memory=1.0)


def time_layouts(cfg: ModelConfig, cases: dict[str, Layout], seq_len: int, global_batch: int, steps: int = 4,
                 seed: int = 0) -> list[dict]:
    """Rank function: for each case {label: layout} (as `memory_measure`), one warm-up step then `steps` timed
    steps (all ranks start each after a barrier); the fastest, the least disturbed by other jobs on a shared
    machine."""
    data = random_batch(cfg, seq_len, global_batch, seed)
    comm, results = Comm(), []
    for label, layout in cases.items():
        parallel, _, batches, _ = build_case(cfg, layout, data, seed)
        seconds = []
        for step in range(steps + 1):
            comm.barrier()
            start = time.perf_counter()
            parallel.forward_backward(batches)
            parallel.clip_grad_norm_(1.0)
            parallel.step()
            comm.barrier()
            if step:
                seconds.append(time.perf_counter() - start)
        results.append({"label": label, "seconds": min(seconds)})
    return results


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's ρ: the Pearson correlation of the ranks of a and b (tied values share their mean rank)."""
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"need two sequences of the same length >= 2, got {len(a)} and {len(b)}")

    def ranks(x: Sequence[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        out = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2 + 1
            i = j + 1
        return out

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0
