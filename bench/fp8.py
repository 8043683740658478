"""FP8 training on a CPU: the `tiny` preset with --fp8 against the same model in fp32, step time as a ratio.

    .venv/bin/python bench/fp8.py [--steps 7] [--threads N] [--torchao]

The model is built as the trainer builds it (`build_model`, then `convert_to_fp8` with the recipe: every linear of
the blocks runs the three FP8 GEMMs), and a step is the trainer's: forward, loss, backward, AdamW, on a batch of
16 x 128 tokens. For each recipe, FP8 and fp32 steps alternate (after one warm-up step each) and the median of the
paired ratios is reported, in this process's CPU time (on a shared machine the wall clock also measures the
neighbours; both are printed). On a CPU the GEMMs run as `minidist.model.fp8_gemm` says: tensorwise and blockwise
as the fp32 matmul of the dequantized operands, rowwise as one `torch._scaled_mm` with row scales; what FP8 costs
here is the quantization around each GEMM, not what it buys on a GPU.

`--torchao`: also minidist's FP8 linears against torchao's float8 training on a d -> 4d -> d MLP (forward + backward,
outputs and gradients checked bit for bit before timing), the reference a user would pick. torchao's tensorwise GEMM
on a CPU is the CPU's reference `_scaled_mm` (~20 M multiply-adds/s): keep `--d-model` small.

Last line: JSON {"tensorwise": FP8 / fp32 step time (CPU time), ..., "wall_tensorwise": ... (+ "torchao_<recipe>")}.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings
from collections.abc import Callable

import torch
from torch import nn

from minidist.model import build_model, get_preset, lm_loss
from minidist.model.fp8_linear import Fp8Linear, Fp8Recipe, convert_to_fp8

RECIPES = ("tensorwise", "rowwise", "blockwise")


def tiny_step(fp8: str) -> Callable[[], None]:
    """One training step of the `tiny` preset with `--fp8 fp8`, built as the trainer builds it."""
    cfg = get_preset("tiny")
    model = build_model(cfg, seed=0)
    convert_to_fp8(model, None if fp8 == "none" else Fp8Recipe(fp8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (16, 129), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()

    step()  # warm-up: allocations, first calls
    return step


def timed(step: Callable[[], None]) -> tuple[float, float]:
    """(CPU seconds of this process, wall seconds) of one call."""
    cpu, wall = time.process_time(), time.perf_counter()
    step()
    return time.process_time() - cpu, time.perf_counter() - wall


def trainer_ratios(steps: int) -> dict[str, float]:
    result = {}
    fp32 = tiny_step("none")
    for recipe in RECIPES:
        fp8 = tiny_step(recipe)
        pairs = [(timed(fp8), timed(fp32)) for _ in range(steps)]
        cpu = statistics.median(a[0] / b[0] for a, b in pairs)
        wall = statistics.median(a[1] / b[1] for a, b in pairs)
        ms = [statistics.median(p[i][0] for p in pairs) * 1e3 for i in (0, 1)]
        print(f"tiny --fp8 {recipe:<10}: {ms[0]:6.0f} ms vs fp32 {ms[1]:6.0f} ms CPU time a step: {cpu:.2f}x "
              f"(wall clock {wall:.2f}x)", flush=True)
        result[recipe], result[f"wall_{recipe}"] = round(cpu, 3), round(wall, 3)
    return result


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


def fwd_bwd(model: nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
    xi = x.clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    y = model(xi)
    y.backward(g)
    return time.perf_counter() - start, [y.detach(), xi.grad, *(p.grad for p in model.parameters())]


def torchao_ratios(d: int, tokens: int, steps: int) -> dict[str, float]:
    torch.manual_seed(0)
    base = mlp(d)
    x, g = torch.randn(tokens, d), torch.randn(tokens, d)
    result = {}
    for recipe in ("tensorwise", "rowwise"):
        mine, reference = ours(base, recipe), torchao_version(base, recipe)
        for a, b in zip(fwd_bwd(mine, x, g)[1], fwd_bwd(reference, x, g)[1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # the same FP8 numbers: bit for bit
        pairs = [(fwd_bwd(mine, x, g)[0], fwd_bwd(reference, x, g)[0]) for _ in range(steps)]
        result[f"torchao_{recipe}"] = round(statistics.median(a / b for a, b in pairs), 3)
        print(f"MLP {d} -> {4 * d} -> {d}, {tokens} tokens, {recipe}: minidist / torchao "
              f"{result[f'torchao_{recipe}']:.3f}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--torchao", action="store_true")
    parser.add_argument("--d-model", type=int, default=64, help="of --torchao's MLP")
    parser.add_argument("--tokens", type=int, default=128, help="of --torchao's MLP")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; tiny preset, 16 x 128 tokens, "
          f"{args.steps} paired steps per recipe", flush=True)
    result = trainer_ratios(args.steps)
    if args.torchao:
        result |= torchao_ratios(args.d_model, args.tokens, args.steps)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
