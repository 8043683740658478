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


def _spread(scales: torch.Tensor, rows: int, cols: int, shape: torch.Size) -> torch.Tensor:
    """One scale per element: each block's scale repeated over its rows × cols (the padding sliced off)."""
    return scales.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)[: shape[0], : shape[1]]


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
    limit = torch.finfo(torch.float8_e4m3fn).max
    scale = (limit / x.detach().abs().max().double().clamp(min=1e-12)).float()
    return (x.float() * scale).clamp(-limit, limit).to(torch.float8_e4m3fn), scale


def quantize_blocks(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D `x` to e4m3 with one scale per block of `rows` × `cols` elements; return (data, scales).

    rows=1, cols=128 gives DeepSeek-V3's activation tiles, rows=cols=128 its weight blocks (DeepSeek-AI 2024, §3.3):
    an outlier then spoils only its own block. `scales` has shape (⌈R/rows⌉, ⌈C/cols⌉) for x of shape (R, C) — the
    last blocks may be partial — and each scale is 448 / (that block's max |x|, floored at 1e-12). `data` has x's
    shape: each element times its own block's scale, saturated to ±448, in torch.float8_e4m3fn.

    Hints: zero-pad x to whole blocks, view it as (R/rows, rows, C/cols, cols) and take amax over dims 1 and 3;
    repeat_interleave spreads the scales back to one per element (slice off the padding).
    """
    limit = torch.finfo(torch.float8_e4m3fn).max
    padded = torch.nn.functional.pad(x.detach().abs().float(), (0, -x.shape[1] % cols, 0, -x.shape[0] % rows))
    amax = padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols).amax(dim=(1, 3))
    scales = (limit / amax.double().clamp(min=1e-12)).float()
    data = (x.float() * _spread(scales, rows, cols, x.shape)).clamp(-limit, limit).to(torch.float8_e4m3fn)
    return data, scales


def dequantize_blocks(data: torch.Tensor, scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The fp32 tensor that block-quantized `data` stands for: each element divided by its block's scale.

    `scales` has one entry per `rows` × `cols` block of `data` (the last blocks may be partial), as
    `quantize_blocks` returns them.

    Hints: the same spreading of the scales as in quantize_blocks; data.float() before dividing.
    """
    return data.float() / _spread(scales, rows, cols, data.shape)


def _rowwise(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t quantized to e4m3 with one scale per slice along `dim` (the amax over `dim`), and dequantized."""
    limit = torch.finfo(torch.float8_e4m3fn).max
    scale = (limit / t.detach().abs().amax(dim=dim, keepdim=True).double().clamp(min=1e-12)).float()
    return (t.float() * scale).clamp(-limit, limit).to(torch.float8_e4m3fn).float() / scale


def fp8_linear_rowwise(x: torch.Tensor, weight: torch.Tensor,
                       grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The three GEMMs of y = x·Wᵀ, each operand scaled along its GEMM's contraction (see exercises/)."""
    k, n = weight.shape[1], weight.shape[0]
    x2, dy2 = x.reshape(-1, k), grad_output.reshape(-1, n)
    y = _rowwise(x2, 1) @ _rowwise(weight, 1).t()  # contracts over K
    dx = _rowwise(dy2, 1) @ _rowwise(weight, 0)  # contracts over N
    dw = _rowwise(dy2, 0).t() @ _rowwise(x2, 0)  # contracts over the M tokens
    return y.reshape(*x.shape[:-1], n), dx.reshape(x.shape), dw


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
    finite = True
    for g in grads:
        g.div_(scale)
        finite = finite and bool(torch.isfinite(g).all())
    if not finite:
        return False, scale / 2, 0
    good_steps += 1
    if good_steps == growth_interval:
        return True, scale * 2, 0
    return True, scale, good_steps
