"""Context-parallel training step: each of minidist's variants (ring, allgather, ulysses) against one process
training the same model on the same sequences, and the activation memory each rank holds.

    .venv/bin/python bench/cp.py [--seq 2048] [--batch 1] [--d-model 128] [--layers 2] [--heads 8] [--kv-heads 2]
                                 [--steps 5] [--warmup 1] [--cps 2,4] [--impls ring,allgather,ulysses]

Why not PyTorch's own: `torch.distributed.tensor.experimental.context_parallel` does not run on CPU in torch 2.13.
On 2 gloo ranks, with the sequence sharded by its context manager, the attention call fails with "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered" (its ring
is registered for the CUDA flash and efficient kernels only; checked when this benchmark was written). So the
reference here is the one-process run: same weights (built from the seed), same tokens, `ParallelModel` without
context parallelism (torch's SDPA kernel).

Time: a step is forward + backward + gradient reduction over the cp ranks + clipping + AdamW. Inside each launch
of cp ranks the variants and the one-process run (on rank 0 alone, the others waiting at the barrier) alternate
step by step, so a change in the machine's load hits them alike; a step's time is the slowest rank's; medians are
reported. The first step's loss of every variant must equal the one-process loss (1e-4 relative) before anything
is timed.
Every process runs one thread: giving the one process all the cores made its time swing tenfold when other jobs
shared the CPU (idle OpenMP threads spinning on oversubscribed cores). So cp ranks use cp cores and the one process
one core: perfect scaling is time_ratio = 1/cp, and time_ratio · cp is the CPU time spent relative to one process.

Memory: per rank, the bytes of the distinct storages autograd saves during one forward (saved-tensor hooks,
parameters excluded): the activations held from the forward to the backward, measured by tensor accounting,
not RSS. cp = 1 of a variant is its attention core on a single-rank group (the same kernel, nothing sharded),
so memory_ratio isolates what splitting the sequence buys: ≈ 1/cp for everything that scales with the tokens.
Last line: JSON with `time_ratio` (per variant: median CP step / median one-process step, at the first of --cps)
and `memory_ratio` (per variant: per-rank activation bytes at cp 2 / at cp 1).
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

from minidist.comm.communicator import Comm
from minidist.comm.launch import run_ranks
from minidist.comm.topology import ParallelDims, Topology
from minidist.model import build_model, get_preset, lm_loss
from minidist.parallel import ParallelModel, ParallelOptions, parallelize
from minidist.parallel.cp import apply_context_parallel


def saved_bytes(model: torch.nn.Module, context, tokens: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward of this rank's tokens (all of
    them without a context-parallel `context`)."""
    positions = None
    if context is not None:
        [(tokens, _)], [positions] = context.shard([(tokens, tokens)])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, positions)
    return sum(seen.values())


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)


def _step(parallel: ParallelModel, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    loss = parallel.forward_backward([(inputs, targets)]).loss
    parallel.clip_grad_norm_(1.0)
    parallel.step()
    return loss


def rank_run(impls: list[str], cfg_kwargs: dict, batch: int, seq: int, steps: int, warmup: int) -> dict:
    """On cp = world size ranks: memory of every variant and step times of the variants and, on rank 0 alone while
    the others wait, of the one-process run, alternating (world 1: memory only, of the one-process run and of each
    variant's core on a single-rank group)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = get_preset("tiny", **cfg_kwargs)
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)
    want = lm_loss(build_model(cfg, seed=0)(inputs), targets).item()
    topo = Topology(ParallelDims(cp=world), rank, world)
    runs: dict[str, ParallelModel] = {}
    memory: dict[str, int] = {}
    if world == 1:
        model = build_model(cfg, seed=0)
        memory["one process"] = saved_bytes(model, None, inputs)
        for name in impls:  # the variant's kernel, nothing sharded
            model = build_model(cfg, seed=0)
            memory[name] = saved_bytes(model, apply_context_parallel(model, Comm(None), name), inputs)
        return {"memory": memory, "loss": want}
    if rank == 0:  # no process group: ParallelModel's defaults are one process
        runs["one process"] = ParallelModel(model := build_model(cfg, seed=0), _optimizer(model))
    for name in impls:
        model = build_model(cfg, seed=0)
        runs[name] = parallelize(model, cfg, topo, ParallelOptions(cp_impl=name), _optimizer)
        memory[name] = saved_bytes(model, runs[name].context, inputs)
    for name in ["one process", *impls]:
        first = _step(runs[name], inputs, targets) if name in runs else want
        if abs(first - want) > 1e-4 * abs(want):
            raise AssertionError(f"{name} on {world} ranks: first loss {first} differs from one process's {want}")
    times: dict[str, list[float]] = {name: [] for name in ["one process", *impls]}
    for i in range(warmup + steps):
        for name in times:  # alternating: a change in the machine's load hits every entry alike
            dist.barrier()
            start = time.perf_counter()
            if name in runs:
                _step(runs[name], inputs, targets)
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace
            if i >= warmup:
                times[name].append(elapsed.item())
    return {"memory": memory, "times": times, "loss": want}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--cps", default="2,4")
    parser.add_argument("--impls", default="ring,allgather,ulysses")
    args = parser.parse_args()
    impls, cps = args.impls.split(","), [int(c) for c in args.cps.split(",")]
    cfg_kwargs = dict(d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, n_kv_heads=args.kv_heads,
                      d_ff=4 * args.d_model, max_seq_len=args.seq)

    me = importlib.import_module(Path(__file__).stem)  # run_ranks needs an importable function
    start = time.perf_counter()
    out = {cp: run_ranks(me.rank_run, cp, impls, cfg_kwargs, args.batch, args.seq, args.steps, args.warmup,
                         timeout=1800, threads_per_rank=1)[0] for cp in [1, *cps]}
    print(f"tiny d_model {args.d_model}, {args.layers} layers, {args.heads} heads ({args.kv_heads} kv), batch "
          f"{args.batch} x seq {args.seq}, gloo CPU ranks, 1 thread each; one process keeps "
          f"{out[1]['memory']['one process'] / 2**20:.1f} MiB of activations; first loss {out[1]['loss']:.4f} "
          "everywhere")
    print(f"{'variant':<11}{'cp':>4}{'step (ms)':>11}{'one process (ms)':>18}{'ratio':>7}"
          f"{'activations/rank (MiB)':>24}{'vs cp 1':>9}")
    time_ratio, memory_ratio = {}, {}
    for impl in impls:
        base = out[1]["memory"][impl]
        print(f"{impl:<11}{1:>4}{'-':>11}{'-':>18}{'-':>7}{base / 2**20:>24.2f}{1.0:>9.3f}")
        for cp in cps:
            mine, one = (statistics.median(out[cp]["times"][name]) for name in (impl, "one process"))
            mem = out[cp]["memory"][impl]
            print(f"{impl:<11}{cp:>4}{1e3 * mine:>11.1f}{1e3 * one:>18.1f}{mine / one:>7.2f}{mem / 2**20:>24.2f}"
                  f"{mem / base:>9.3f}")
            if cp == cps[0]:
                time_ratio[impl] = round(mine / one, 3)
        memory_ratio[impl] = round(out[2]["memory"][impl] / base, 3) if 2 in out else None
    one = statistics.median(out[cps[0]]["times"]["one process"])
    print(json.dumps({"time_ratio": time_ratio, "memory_ratio": memory_ratio, "cp": cps[0], "seq": args.seq,
                      "batch": args.batch, "d_model": args.d_model, "layers": args.layers, "one_process_ms":
                      round(1e3 * one, 1), "wall_s": round(time.perf_counter() - start, 1)}))


if __name__ == "__main__":
    main()
