"""Chapter 16 exercises: a saturating e4m3 quantizer with one per-tensor scale; the 1×B / B×B block quantizer and
its dequantization (DeepSeek-V3's fine-grained scaling); the FP8 linear's three GEMMs, each scaled along
its own contraction; one step of a dynamic loss scaler.

Grade your answers with `make grade CH=16`. The grader checks:
  - quantize_e4m3: the largest |x| maps to ±448 exactly, x ≈ data / scale, an all-zero tensor gets a finite
    scale, the result is torch.float8_e4m3fn;
  - quantize_blocks / dequantize_blocks: the scales' shape (⌈rows/R⌉, ⌈cols/C⌉) on shapes that are not whole
    blocks, each block's own maximum maps to ±448, an outlier degrades only its own block, the round trip is
    within half an e4m3 ulp;
  - fp8_linear_rowwise: the three GEMMs of an FP8 linear (forward, input gradient, weight gradient), each operand
    scaled along that GEMM's own contraction axis, against an oracle; a wrong axis is named;
  - loss_scaler_step: an inf or a NaN gradient skips the step, halves the scale and resets the count of clean
    steps; a clean step divides the gradients by the scale (not multiplies); the scale doubles after
    growth_interval clean steps in a row.
"""

import torch


def quantize_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` to torch.float8_e4m3fn with one scale for the whole tensor; return (data, scale).

    e4m3 (4 exponent bits, bias 7, 3 mantissa bits, no infinities) reaches ±448 (chapter 16, §1). Scale the tensor
    so that its largest magnitude lands exactly on 448: scale = 448 / amax, with amax = max |x| (floor it at 1e-12
    so an all-zero tensor does not divide by zero), and keep the scale in fp32. The FP8 data is x · scale, clamped
    to [-448, 448] before the cast, so that x ≈ data.float() / scale.

    Why clamp, when the largest |x · scale| is 448 by construction? Rounding of the scale can push it a hair past,
    and a delayed (stale) scale far past. torch 2.13's cast to float8_e4m3fn happens to saturate by itself (1e6 and
    inf become 448), so the grader cannot tell whether you clamped; the cast to e5m2, or another library's e4m3
    cast, gives inf or NaN instead. Clamp: it states the intent and does not depend on the cast.

    Hints: torch.finfo(torch.float8_e4m3fn).max is 448; clamp, then .to(torch.float8_e4m3fn).
    """
    raise NotImplementedError


def quantize_blocks(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D `x` to e4m3 with one scale per block of `rows` × `cols` elements; return (data, scales).

    rows=1, cols=128 gives DeepSeek-V3's activation tiles, rows=cols=128 its weight blocks (DeepSeek-AI 2024, §3.3):
    an outlier then spoils only its own block. `scales` has shape (⌈R/rows⌉, ⌈C/cols⌉) for x of shape (R, C) — the
    last blocks may be partial — and each scale is 448 / (that block's max |x|, floored at 1e-12). `data` has x's
    shape: each element times its own block's scale, saturated to ±448, in torch.float8_e4m3fn.

    Hints: zero-pad x to whole blocks, view it as (R/rows, rows, C/cols, cols) and take amax over dims 1 and 3;
    repeat_interleave spreads the scales back to one per element (slice off the padding).
    """
    raise NotImplementedError


def dequantize_blocks(data: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The fp32 tensor that block-quantized `data` stands for: each element divided by its block's scale.

    `scales` has one entry per `rows` × `cols` block of `data` (the last blocks may be partial), as
    `quantize_blocks` returns them.

    Hints: the same spreading of the scales as in quantize_blocks; data.float() before dividing.
    """
    raise NotImplementedError


def fp8_linear_rowwise(x: torch.Tensor, weight: torch.Tensor,
                       grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three GEMMs of an FP8 linear y = x·Wᵀ under the rowwise recipe; return (y, dx, dw) in fp32.

    x is [..., K] (every leading position a token: M tokens in all), weight [N, K], grad_output [..., N] (the
    gradient of y). Each GEMM reads two operands quantized to e4m3, each with **one scale per index the GEMM does
    not sum over**, the amax taken along the index it sums over (its contraction), so that the scales factor out of
    every dot product (what `torch._scaled_mm` requires: an (M, 1) scale for the left operand, a (1, N) one for the
    right):

    - forward y = x·Wᵀ contracts over K: x's amax over K (one scale per token), W's over K (one per output row);
    - input gradient dx = dy·W contracts over N: dy's amax over N (one per token), W's over N (one per column of W):
      not the forward's quantized W;
    - weight gradient dW = dyᵀ·x contracts over the M tokens: dy's amax over the tokens (one per output feature),
      x's over the tokens (one per input feature).

    Quantize as in `quantize_e4m3` but per row of the chosen axis: scale = 448 / amax (amax floored at 1e-12, the
    scale in fp32), data = (t · scale) clamped to ±448, cast to torch.float8_e4m3fn. Emulate each FP8 GEMM by the
    fp32 matmul of the dequantized operands (data.float() / scale): on a CPU that is bit for bit what `_scaled_mm`
    gives with rowwise scales. The rowwise recipe keeps e4m3 for the gradient too. dx has x's shape, dW weight's.

    Hints: flatten the leading dimensions first (x.reshape(-1, K)); a helper `q(t, dim)` that returns t quantized
    and dequantized with the amax over `dim` (keepdim=True) serves all six operands.
    """
    raise NotImplementedError


def loss_scaler_step(grads: list[torch.Tensor], scale: float, good_steps: int,
                     growth_interval: int = 2000) -> tuple[bool, float, int]:
    """One optimizer step's decision of a dynamic loss scaler; return (take_step, new_scale, new_good_steps).

    The loss was multiplied by `scale` before the backward, so every gradient in `grads` is `scale` times too large
    (Micikevicius et al. 2018, §3.2). Divide each gradient by `scale` in place (they are fp32 master gradients).
    If any gradient holds an inf or a NaN, the scale was too large: skip the step, halve the scale, and restart the
    count of clean steps at 0. Otherwise take the step and count it; after `growth_interval` clean steps in a row,
    double the scale (try a larger one: more small gradients survive fp16) and restart the count at 0.

    Hints: torch.isfinite(g).all() is False for inf and for NaN.
    """
    raise NotImplementedError
