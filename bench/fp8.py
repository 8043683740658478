"""FP8 linear layers against torchao's float8 training (the reference a user would pick), forward + backward.

    .venv/bin/python bench/fp8.py [--tokens 256] [--d-model 256] [--steps 9] [--threads N]

A two-layer MLP (d -> 4d -> d, no bias) in three versions from the same weights: fp32 `nn.Linear`, minidist's
`Fp8Linear` (`minidist.model.fp8_linear`, the trainer's `--fp8`), and torchao's `convert_to_float8_training` with
the same recipe. For tensorwise and rowwise, outputs and gradients are checked against torchao before timing
on the first linear alone (tensorwise bit for bit, rowwise within one bf16 rounding: torchao's rowwise GEMM writes
bf16, and a second layer would re-round its input to FP8 differently). Steps alternate
between the implementations so machine load hits all alike; the median of the paired per-step ratios is reported.
On a CPU `torch._scaled_mm` is an emulation (~20 M multiply-adds/s): the ratios say what each implementation adds
around the GEMMs, not what FP8 buys on a GPU; keep the shapes small.

Last line: JSON {"ratio_tensorwise": minidist / torchao, "ratio_rowwise": ..., "vs_fp32_...": minidist / fp32}.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings

import torch
from torch import nn

from minidist.model.fp8_linear import Fp8Linear, Fp8Recipe


def mlp(d: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.SiLU(), nn.Linear(4 * d, d, bias=False))


def ours(model: nn.Sequential, recipe: str) -> nn.Sequential:
    out = copy.deepcopy(model)
    for i, layer in enumerate(out):
        if isinstance(layer, nn.Linear):
            out[i] = Fp8Linear(layer, Fp8Recipe(recipe))
    return out


def torchao_version(model: nn.Sequential, recipe: str) -> nn.Sequential:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its CUDA-only extensions do not load on a CPU
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    out = copy.deepcopy(model)
    convert_to_float8_training(out, config=Float8LinearConfig.from_recipe_name(recipe))
    return out


def step(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[float, torch.Tensor, list[torch.Tensor]]:
    xi = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    y = model(xi)
    y.backward(g)
    seconds = time.perf_counter() - start
    return seconds, y.detach(), [xi.grad, *(p.grad for p in model.parameters())]


def check(recipe: str, a: nn.Module, b: nn.Module, x: torch.Tensor, g: torch.Tensor) -> None:
    _, ya, ga = step(a, x, g)
    _, yb, gb = step(b, x, g)
    rtol = 0.0 if recipe == "tensorwise" else 2.0**-8
    for got, want in zip([ya, *ga], [yb, *gb]):
        torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * float(want.abs().max()) + 1e-6)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    base = mlp(args.d_model)
    x, g = torch.randn(args.tokens, args.d_model), torch.randn(args.tokens, args.d_model)
    result = {}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; MLP {args.d_model} -> "
          f"{4 * args.d_model} -> {args.d_model}, {args.tokens} tokens, {args.steps} steps each (median)")
    for recipe in ("tensorwise", "rowwise"):
        mine, reference = ours(base, recipe), torchao_version(base, recipe)
        first = nn.Sequential(base[0])  # one linear: no FP8 re-rounding of a second layer's input
        g_first = torch.randn(args.tokens, 4 * args.d_model)
        check(recipe, ours(first, recipe), torchao_version(first, recipe), x, g_first)
        times = {"minidist": [], "torchao": [], "fp32": []}
        for _ in range(args.steps):
            for name, model in (("minidist", mine), ("torchao", reference), ("fp32", base)):
                times[name].append(step(model, x, g)[0])
        ratio = statistics.median(a / b for a, b in zip(times["minidist"], times["torchao"]))
        vs_fp32 = statistics.median(a / b for a, b in zip(times["minidist"], times["fp32"]))
        ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        print(f"{recipe:<11} minidist {ms['minidist']:8.2f} ms | torchao {ms['torchao']:8.2f} ms | fp32 "
              f"{ms['fp32']:7.2f} ms | minidist/torchao {ratio:.3f}")
        result[f"ratio_{recipe}"], result[f"vs_fp32_{recipe}"] = round(ratio, 4), round(vs_fp32, 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
