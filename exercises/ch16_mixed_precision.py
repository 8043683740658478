"""Chapter 16 exercises: a saturating e4m3 quantizer with one per-tensor scale; the 1×B / B×B block quantizer and
its dequantization (DeepSeek-V3's fine-grained scaling); one step of a dynamic loss scaler.

Grade your answers with `make grade CH=16`. The grader checks:
  - quantize_e4m3: the largest |x| maps to ±448 exactly, x ≈ data / scale, values past the range saturate (never
    NaN), an all-zero tensor gets a finite scale, the result is torch.float8_e4m3fn;
  - quantize_blocks / dequantize_blocks: the scales' shape (⌈rows/R⌉, ⌈cols/C⌉) on shapes that are not whole
    blocks, each block's own maximum maps to ±448, an outlier degrades only its own block, the round trip is
    within half an e4m3 ulp;
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
    to [-448, 448] before the cast (saturation: a value past the range must become ±448, never NaN), so that
    x ≈ data.float() / scale.

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
