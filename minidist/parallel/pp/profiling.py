"""Measuring pipeline schedules (notebook 09, benchmarks): a rank function that runs schedules on random tokens."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from minidist.comm.communicator import Ledger
from minidist.comm.topology import ParallelDims, Topology
from minidist.model.config import ModelConfig
from minidist.model.transformer import build_model
from minidist.parallel.pp.pipeline import PipelineRunner, partition_model


def profile_pipeline(cfg: ModelConfig, runs: Iterable[tuple[str, int, int]], batch_size: int, seq_len: int,
                     steps: int = 2, seed: int = 0, measure_memory: bool = True) -> list[dict]:
    """Rank function for `run_ranks(profile_pipeline, pp, ...)`: run schedules on random tokens, no optimizer.

    For each (schedule, microbatches, virtual_stages) in `runs`: partition a model built from (cfg, seed), run
    `steps` steps (all ranks start each step after a barrier) and return a dict with `events`, one list per step
    (time.perf_counter(), one clock for all processes of a machine), the last step's `loss` (mean over tokens),
    `peak_activation_bytes`, `peak_in_flight`, `send_bytes` (point to point, from the ledger) and the first step's
    gradients by name (`grads`).
    """
    topo = Topology(ParallelDims(pp=dist.get_world_size()), dist.get_rank(), dist.get_world_size())
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), generator=generator)
    targets = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), generator=generator)
    results = []
    for schedule, m, v in runs:
        stage = partition_model(build_model(cfg, seed), topo.coord("pp"), topo.size("pp"), v, schedule=schedule)
        ledger = Ledger()
        runner = PipelineRunner(stage, topo.comm("pp", ledger), schedule, m, v, measure_memory=measure_memory)
        batches = list(zip(inputs.chunk(m), targets.chunk(m)))
        events = []
        for step in range(steps):
            stage.zero_grad(set_to_none=True)
            ledger.reset()
            runner.comm.barrier()
            stats = runner.step(batches, loss_scale=1.0 / targets.numel())  # no ignored targets
            events.append(stats.events)
            if step == 0:
                grads = {n: p.grad.detach().clone() for n, p in stage.named_parameters()}
        results.append({"schedule": schedule, "microbatches": m, "virtual_stages": v, "events": events,
                        "loss": stats.loss / targets.numel(), "peak_activation_bytes": stats.peak_activation_bytes,
                        "peak_in_flight": stats.peak_in_flight, "grads": grads,
                        "send_bytes": ledger.bytes("send", "pp")})
    return results
