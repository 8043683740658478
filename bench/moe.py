"""Sorted MoE dispatch against the naive per-expert boolean-mask loop, forward + backward.

    .venv/bin/python bench/moe.py [--tokens 4096] [--d-model 256] [--repeats 7] [--threads N]

Three implementations of the same layer (same weights, same routing): "naive" = `moe_forward_naive`, for each
expert a mask (indices == e) selects its tokens; "sorted-loop" = `MoELayer` with one argsort of the expert ids,
index_select into contiguous per-expert slices, one matmul per expert, index_add back; "sorted-grouped" = the same
with torch._grouped_mm in place of the per-expert loop (skipped where it does not take the operands). Outputs
are checked equal before timing. Each step is forward + backward of sum(y·g); the implementations alternate step
by step, so a change in machine load hits all alike; the median is reported.

Last line: JSON with `ratio` = sorted dispatch time / naive time (forward + backward, the "auto" backend, first
configuration) and the per-configuration ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from minidist.model import get_preset
from minidist.model.moe.dispatch import grouped_mm_works
from minidist.model.moe.layer import MoELayer, moe_forward_naive

CONFIGS = {
    # name: (n_experts, top_k, d_expert as a multiple of d_model, n_shared)
    "mixtral-like 8 experts top-2": (8, 2, 2.0, 0),
    "fine-grained 64 experts top-6 + 2 shared": (64, 6, 0.25, 2),
}


def build_layer(d_model: int, n_experts: int, top_k: int, d_expert: int, n_shared: int, seed: int) -> MoELayer:
    cfg = get_preset("tiny", d_model=d_model, n_heads=4, n_kv_heads=2,
                     moe=dict(n_experts=n_experts, top_k=top_k, d_expert=d_expert, n_shared_experts=n_shared))
    layer = MoELayer(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * d_model**-0.5)
    return layer


def step(layer: MoELayer, impl: str, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Forward + backward of sum(y·g) with one implementation; returns y."""
    if impl == "naive":
        y = moe_forward_naive(layer, x)
    else:
        layer.experts.backend = {"sorted-loop": "loop", "sorted-grouped": "grouped_mm"}[impl]
        y = layer(x)
    (y * g).sum().backward()
    return y.detach()


def time_config(spec: tuple[int, int, float, int], args: argparse.Namespace) -> dict[str, float]:
    """Median seconds per forward + backward of each implementation on one configuration."""
    n_experts, top_k, mult, n_shared = spec
    layer = build_layer(args.d_model, n_experts, top_k, int(mult * args.d_model), n_shared, seed=0)
    x = torch.randn(args.tokens, args.d_model, generator=torch.Generator().manual_seed(1)).requires_grad_()
    g = torch.randn(args.tokens, args.d_model, generator=torch.Generator().manual_seed(2))
    impls = ["naive", "sorted-loop"]
    if grouped_mm_works(x.detach(), layer.experts.w1):
        impls.append("sorted-grouped")
    reference = step(layer, "naive", x, g)
    for impl in impls:
        torch.testing.assert_close(step(layer, impl, x, g), reference, rtol=1e-4, atol=1e-5, msg=impl)
    times: dict[str, list[float]] = {impl: [] for impl in impls}
    for i in range(args.warmup + args.repeats):
        for impl in impls:
            start = time.perf_counter()
            step(layer, impl, x, g)
            if i >= args.warmup:
                times[impl].append(time.perf_counter() - start)
    return {impl: statistics.median(t) for impl, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per forward (batch × sequence)")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per implementation (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.tokens} tokens, "
          f"d_model {args.d_model}, forward + backward, median of {args.repeats}")
    print(f"{'configuration':<42} {'implementation':<16} {'ms':>9} {'vs naive':>9}")
    ratios = {}
    for name, spec in CONFIGS.items():
        median = time_config(spec, args)
        for impl, t in median.items():
            print(f"{name:<42} {impl:<16} {1e3 * t:9.2f} {t / median['naive']:9.3f}")
        ratios[name] = {impl: round(t / median["naive"], 4) for impl, t in median.items() if impl != "naive"}
        ratios[name]["auto"] = "sorted-grouped" if "sorted-grouped" in median else "sorted-loop"

    first = next(iter(ratios.values()))
    print(json.dumps({"ratio": first[first["auto"]], "tokens": args.tokens, "d_model": args.d_model,
                      "threads": torch.get_num_threads(), "configs": ratios}))


if __name__ == "__main__":
    main()
