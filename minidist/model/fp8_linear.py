"""The FP8 linear layer: one entry point (`linear`) that the blocks' linears and tensor parallelism's sharded
linears all call, three recipes, and the autograd function behind it.

Y = X Wᵀ costs three GEMMs per step, each fed two quantized operands scaled along its own contraction dimension:
forward Y = X Wᵀ (over K), input gradient dX = dY W (over N), weight gradient dW = dYᵀ X (over the tokens M).
Each runs as one FP8 GEMM (`minidist.model.fp8_gemm`: which kernel the hardware at hand has, and why) accumulating
in fp32 and writing the layer's dtype (the autocast dtype if autocast is on).

- tensorwise: one scale per operand; X and W in e4m3, dY in e5m2 (gradients need range more than precision;
  torchao's default recipe); a `torch._scaled_mm` with scalar scales on CUDA;
- rowwise: one scale per row along each GEMM's contraction, all e4m3, scales rounded down to powers of two
  (torchao's rowwise recipe); one `torch._scaled_mm` with (M, 1) and (1, N) scales, written in bf16;
- blockwise (DeepSeek-V3 §3.3): activations and gradients in 1×b tiles along the contraction, weights in b×b
  blocks, all e4m3. torch's CUDA block-scaled GEMM takes 1×128 and 128×128 scales on sm90 (CUDA >= 12.9, blocks
  of 128) and runs the GEMM there; the CPU's `_scaled_mm` takes no block scales (a CPU runs the dequantized fp32
  matmul), and on other GPUs the GEMM walks K one block at a time with per-row scales, summing the partial
  products in fp32: the "promotion" of partial sums DeepSeek-V3 §3.3.2 makes every 128 elements on the tensor
  cores.

Under tensor parallelism a scaling group may span ranks: a row-parallel linear splits K (the rows of X and W that
the forward scales), a column-parallel one splits N (what the input gradient scales over). `TpScales` names the
split dimension; any group that crosses it takes its maximum over the tp ranks (a MAX all-reduce through `Comm`),
so every rank uses the scale the unsharded layer would. Blockwise needs no reduction when each shard is whole
blocks, which the trainer checks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from minidist.model.fp8 import E4M3, E5M2, Quantized, dequantize, quantize, snr_db
from minidist.model.fp8_gemm import choose_kernel, fp8_gemm, native_blockwise, row_major

RECIPES = ("tensorwise", "rowwise", "blockwise")
ROLES = ("input", "weight", "grad")


@dataclass(frozen=True)
class Fp8Recipe:
    """How each operand role is quantized: granularity, FP8 dtype, power-of-two scales; `block` for blockwise."""

    name: str
    block: int = 128

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise ValueError(f"fp8 recipe {self.name!r} is unknown; choose one of {RECIPES}")
        if self.block < 1:
            raise ValueError(f"fp8 block size must be positive, got {self.block}")

    def granularity(self, role: str) -> str:
        if self.name == "tensorwise":
            return "tensor"
        if self.name == "rowwise":
            return "row"
        return "block" if role == "weight" else "tile"

    def dtype(self, role: str) -> torch.dtype:
        return E5M2 if self.name == "tensorwise" and role == "grad" else E4M3

    @property
    def power_of_2(self) -> bool:
        return self.name == "rowwise"


@dataclass(frozen=True)
class TpScales:
    """A linear sharded over tp: `sharded` is the split dimension ("N": column-parallel, "K": row-parallel);
    `reduce_max` takes maxima over the tp ranks in place and returns them."""

    reduce_max: Callable[[torch.Tensor], torch.Tensor]
    sharded: str

    def needs_reduce(self, granularity: str, dims: tuple[str, str]) -> bool:
        """A scaling group crosses ranks: a whole-tensor max of a sharded operand, a row max along a split."""
        if granularity == "tensor":
            return self.sharded in dims
        return granularity == "row" and dims[1] == self.sharded


def quantize_operand(t: torch.Tensor, role: str, dims: tuple[str, str], recipe: Fp8Recipe,
                     tp: TpScales | None = None) -> Quantized:
    """One GEMM operand as (rows, contraction) = `dims` of the (M, N, K) problem, quantized per `recipe`."""
    granularity = recipe.granularity(role)
    reduce = tp.reduce_max if tp is not None and tp.needs_reduce(granularity, dims) else None
    return quantize(t, recipe.dtype(role), granularity, recipe.block, recipe.power_of_2, reduce)


def gemm_kernel(a: Quantized, b: Quantized, native: bool | None = None) -> str:
    """The kernel `scaled_matmul` runs a @ bᵀ with on these operands' device (`fp8_gemm.choose_kernel`); `native`
    overrides whether the device has torch's block-scaled GEMM (the contract check rehearses a GPU's choice)."""
    device = a.data.device
    native = native_blockwise(device) if native is None else native
    return choose_kernel(a.granularity, b.granularity, device.type, a.block, b.data.shape[0], a.data.shape[1],
                         native)


def gemm_kernels(recipe: Fp8Recipe | None, device: torch.device) -> dict[str, str]:
    """Which kernel runs each of the recipe's three GEMMs on `device` (what run.json records; {} without FP8). The
    native block-scaled GEMM needs contractions (and a 128x128 operand's rows) of whole blocks of 128: said so."""
    if recipe is None:
        return {}
    native = native_blockwise(device)
    roles = {"forward": ("input", "weight"), "input gradient": ("grad", "weight"), "weight gradient": ("grad", "input")}
    kernels = {}
    for gemm, (a, b) in roles.items():
        kernel = choose_kernel(recipe.granularity(a), recipe.granularity(b), device.type, recipe.block, 128, 128,
                               native)
        kernels[gemm] = kernel + (", else sliced_scaled_mm" if kernel == "scaled_mm_blockwise" else "")
    return kernels


def scaled_matmul(a: Quantized, b: Quantized, out_dtype: torch.dtype = torch.float32,
                  native: bool | None = None) -> torch.Tensor:
    """a @ bᵀ from two operands quantized along their columns (the contraction), fp32 accumulation, written in
    `out_dtype`: one FP8 GEMM (`fp8_gemm`), by the kernel `gemm_kernel` picks."""
    kernel = gemm_kernel(a, b, native)
    return fp8_gemm(row_major(a.data), a.scale.reciprocal(), row_major(b.data), b.scale.reciprocal(),
                    a.granularity, b.granularity, a.block, kernel, out_dtype)


def forward_gemm(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe, tp: TpScales | None,
                 out_dtype: torch.dtype, native: bool | None = None) -> torch.Tensor:
    """Y = X Wᵀ: contraction over K."""
    xq = quantize_operand(x, "input", ("M", "K"), recipe, tp)
    wq = quantize_operand(weight, "weight", ("N", "K"), recipe, tp)
    return scaled_matmul(xq, wq, out_dtype, native)


def input_grad_gemm(grad: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe, tp: TpScales | None,
                    out_dtype: torch.dtype, native: bool | None = None) -> torch.Tensor:
    """dX = dY W: contraction over N."""
    gq = quantize_operand(grad, "grad", ("M", "N"), recipe, tp)
    wq = quantize_operand(weight.t(), "weight", ("K", "N"), recipe, tp)
    return scaled_matmul(gq, wq, out_dtype, native)


def weight_grad_gemm(grad: torch.Tensor, x: torch.Tensor, recipe: Fp8Recipe, tp: TpScales | None,
                     out_dtype: torch.dtype, native: bool | None = None) -> torch.Tensor:
    """dW = dYᵀ X: contraction over the tokens M."""
    gq = quantize_operand(grad.t(), "grad", ("N", "M"), recipe, tp)
    xq = quantize_operand(x.t(), "input", ("K", "M"), recipe, tp)
    return scaled_matmul(gq, xq, out_dtype, native)


class _Fp8Matmul(torch.autograd.Function):
    """Y = X Wᵀ for 2-D X (M, K) and W (N, K); each of the three GEMMs quantizes its own operands. A zero-bubble
    pipeline's split backward (`split_backward.backward_input` / `backward_weight`) tells the node which half it
    runs (`split_phase`): B computes dX only, W dW only, so the split costs the fused backward's two GEMMs."""

    splits_by_phase = True  # read by split_backward: it sets `split_phase` on this node's context

    @staticmethod
    def forward(ctx, x, weight, recipe: Fp8Recipe, tp: TpScales | None, out_dtype: torch.dtype):
        ctx.save_for_backward(x, weight)
        ctx.recipe, ctx.tp = recipe, tp
        return forward_gemm(x, weight, recipe, tp, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        recipe, tp = ctx.recipe, ctx.tp
        phase = getattr(ctx, "split_phase", None)  # "input" (B), "weight" (W) or None (a fused backward: both)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0] and phase != "weight":
            grad_x = input_grad_gemm(grad, weight, recipe, tp, x.dtype)
        if ctx.needs_input_grad[1] and phase != "input":
            grad_w = weight_grad_gemm(grad, x, recipe, tp, weight.dtype)
        return grad_x, grad_w, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           recipe: Fp8Recipe | None = None, tp: TpScales | None = None) -> torch.Tensor:
    """The one linear of the blocks: `F.linear` without a recipe, else the FP8 GEMMs (fp32 accumulation; the
    output written in the autocast dtype if autocast is on, else in x's dtype; the bias added in that precision)."""
    if recipe is None:
        return F.linear(x, weight, bias)
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, recipe, tp, out_dtype)
    y = y.view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias.to(out_dtype)


class Fp8Linear(nn.Linear):
    """An nn.Linear (the same Parameters, the same names) whose forward runs the FP8 recipe."""

    def __init__(self, full: nn.Linear, recipe: Fp8Recipe) -> None:
        nn.Module.__init__(self)  # keep `full`'s parameters: no allocation, init by (seed, name) unchanged
        self.weight, self.bias = full.weight, full.bias
        self.out_features, self.in_features = self.weight.shape
        self.fp8 = recipe

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.fp8)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8={self.fp8.name}"


def convert_to_fp8(model: nn.Module, recipe: Fp8Recipe | None) -> list[str]:
    """Swap every nn.Linear inside `model.blocks` for an Fp8Linear, except MoE routers (their logits decide
    which expert a token visits: kept in fp32). The embedding, the head and the norms are not linears of the
    blocks; routed experts hold batched weights, not nn.Linear, and stay in high precision. Returns the names."""
    if recipe is None:
        return []
    names = [name for name, m in model.blocks.named_modules()
             if type(m) is nn.Linear and not name.endswith("router")]
    for name in names:
        model.blocks.set_submodule(name, Fp8Linear(model.blocks.get_submodule(name), recipe))
    return [f"blocks.{n}" for n in names]


@contextlib.contextmanager
def quantization_snr(model: nn.Module, enabled: bool = True) -> Iterator[dict[str, list[float]]]:
    """While active, every FP8 linear's forward records the SNR in dB of its forward operands' quantization (with
    the scales it uses, tp maxima included): {name: [input dB, weight dB]}, the mean over the forwards, filled in
    when the block exits. Host reads: for evaluation steps only."""
    seen: dict[str, list[tuple[float, float]]] = {}
    summary: dict[str, list[float]] = {}

    def hook(name: str) -> Callable:
        def record(module: nn.Module, args: tuple) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            recipe, tp = module.fp8, getattr(module, "fp8_tp", None)
            xq = quantize_operand(x, "input", ("M", "K"), recipe, tp)
            wq = quantize_operand(module.weight.detach(), "weight", ("N", "K"), recipe, tp)
            seen.setdefault(name, []).append((snr_db(x, dequantize(xq)), snr_db(module.weight, dequantize(wq))))
        return record

    modules = [(n, m) for n, m in model.named_modules() if getattr(m, "fp8", None) is not None] if enabled else []
    handles = [m.register_forward_pre_hook(hook(n)) for n, m in modules]
    try:
        yield summary
    finally:
        for h in handles:
            h.remove()
        for name, values in seen.items():
            summary[name] = [round(sum(v[i] for v in values) / len(values), 2) for i in (0, 1)]
