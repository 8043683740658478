"""Zero-bubble's split backward under torch.compile: T_B + T_W against the fused backward, on one process.

    .venv/bin/python bench/zb_compile.py [--d-model 256] [--layers 4] [--seq 256] [--batch 4] [--repeats 7]
                                         [--backend aot_eager]

A pipeline chunk of `--layers` blocks (its input a leaf that needs a gradient, as a middle stage's), three ways:

- `eager`: the blocks uncompiled; fused backward, then B (`backward_input`) and W (`backward_weight`);
- `compiled`: every block compiled whole (one autograd node per block, computing all its gradients at once): B
  runs it once and keeps its weight gradients, W only hands them on;
- `compiled, GEMMs eager`: what the trainer compiles under a zero-bubble schedule (`keep_gemms_eager`): the
  weight-owning modules outside the graphs, so W holds the weight GEMMs.

For each: the median of `--repeats` fused backwards and of B and W (a fresh forward before each), and the gradients
of B + W against the fused backward's (max relative difference). W's share of the fused time says how much of the
backward a schedule can move into its bubbles: about half where the weight GEMMs are W's.
Last line: JSON with, per way, `fused_s`, `b_s`, `w_s`, `split_over_fused` ((B + W) / fused) and `max_rel_diff`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

from minidist.model import build_model, get_preset
from minidist.parallel.pp.split_backward import backward_input, backward_weight
from minidist.train.blocks import compile_blocks, keep_gemms_eager


def build(args: argparse.Namespace, way: str) -> torch.nn.Module:
    cfg = dataclasses.replace(get_preset("tiny"), d_model=args.d_model, n_heads=8, n_kv_heads=4,
                              d_ff=4 * args.d_model, n_layers=args.layers, max_seq_len=args.seq)
    chunk = build_model(cfg, seed=0)
    if way != "eager":
        torch._dynamo.reset()
        compile_blocks(chunk, args.backend)
    if way == "compiled, GEMMs eager":
        keep_gemms_eager(chunk)
    return chunk


def forward(chunk: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = x.detach().requires_grad_()
    return leaf, chunk(leaf, embed=False, head=False)  # a middle stage: hidden states in and out


def measure(chunk: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, repeats: int) -> dict:
    params = [p for block in chunk.blocks for p in block.parameters()]
    fused, b_times, w_times = [], [], []
    for _ in range(repeats + 1):  # the first of each is a warm-up (and the compile)
        for p in params:
            p.grad = None
        leaf, y = forward(chunk, x)
        start = time.perf_counter()
        torch.autograd.backward([y], [dy])
        fused.append(time.perf_counter() - start)
        want = [p.grad.clone() for p in params] + [leaf.grad.clone()]
        for p in params:
            p.grad = None
        leaf, y = forward(chunk, x)
        start = time.perf_counter()
        (dx,), work = backward_input([y], [dy], [leaf])
        b_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        backward_weight(work)
        w_times.append(time.perf_counter() - start)
    got = [p.grad for p in params] + [dx]
    diff = max(((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() for g, w in zip(got, want))
    f, b, w = (statistics.median(t[1:]) for t in (fused, b_times, w_times))
    return {"fused_s": f, "b_s": b, "w_s": w, "split_over_fused": (b + w) / f, "max_rel_diff": diff}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one: steadier on a shared CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    x = torch.randn(args.batch, args.seq, args.d_model)
    dy = torch.randn(args.batch, args.seq, args.d_model)
    results = {}
    for way in ("eager", "compiled", "compiled, GEMMs eager"):
        results[way] = r = measure(build(args, way), x, dy, args.repeats)
        print(f"{way:>22}: fused {r['fused_s'] * 1e3:7.1f} ms | B {r['b_s'] * 1e3:7.1f} ms + W {r['w_s'] * 1e3:7.1f} "
              f"ms = {r['split_over_fused']:.2f} x fused | gradients max rel diff {r['max_rel_diff']:.1e}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
