"""Grade chapter 16's exercises: a saturating per-tensor e4m3 quantizer, the block quantizer and its inverse, and a
dynamic loss scaler's step.

`pytest tests/exercises -k ch16` grades solutions/ (the default); add `--impl exercises` to grade your own answers
(`make grade CH=16`). The oracles: torch.finfo, the package's quantizer (`minidist.model.fp8.quantize`, checked
against torchao in tests/test_fp8.py), and gradients built here with a known overflow.
"""

import math

import torch
from grading import load

from minidist.model.fp8 import E4M3, dequantize, quantize

MODULE = "ch16_mixed_precision"


def test_ch16_quantize_e4m3(impl: str) -> None:
    quantize_e4m3 = load(impl, MODULE, "quantize_e4m3")
    torch.manual_seed(0)
    x = torch.randn(8, 16) * 3
    data, scale = quantize_e4m3(x)
    assert data.dtype == E4M3, f"quantize_e4m3: data must be torch.float8_e4m3fn, got {data.dtype}"
    top = float(data.float().abs().max())
    assert top == 448.0, (f"quantize_e4m3: the largest |x| must land on 448, got {top} — is the scale 448 / amax "
                          "(not amax / 448, not 240 or 57344: those are other formats' maxima)?")
    back = data.float() / scale
    assert float(((back - x).abs() / x.abs()).max()) <= 2.0**-4 + 1e-6, (
        "quantize_e4m3: x ≈ data / scale fails by more than half an e4m3 ulp — multiply by the scale before the "
        "cast, divide to dequantize")
    assert torch.equal(data, quantize(x, E4M3, "tensor").data), "quantize_e4m3: differs from the chapter's quantizer"
    zero_data, zero_scale = quantize_e4m3(torch.zeros(4, 4))
    assert math.isfinite(float(zero_scale)) and not torch.isnan(zero_data.float()).any(), (
        "quantize_e4m3: an all-zero tensor gives a NaN or infinite scale — floor amax at 1e-12")


def test_ch16_quantize_blocks(impl: str) -> None:
    quantize_blocks = load(impl, MODULE, "quantize_blocks")
    dequantize_blocks = load(impl, MODULE, "dequantize_blocks")
    torch.manual_seed(1)
    x = torch.randn(40, 72)  # not whole 16x16 blocks: the last row and column of blocks are partial
    for rows, cols, granularity in ((16, 16, "block"), (1, 16, "tile")):
        data, scales = quantize_blocks(x, rows, cols)
        want = (math.ceil(40 / rows), math.ceil(72 / cols))
        assert tuple(scales.shape) == want, (
            f"quantize_blocks {rows}x{cols}: scales of shape {tuple(scales.shape)}, expected {want} — count partial "
            "blocks at the edges (ceil, pad with zeros)")
        ref = quantize(x, E4M3, granularity, block=16)
        torch.testing.assert_close(scales, ref.scale, msg=f"quantize_blocks {rows}x{cols}: scales differ from "
                                   "448 / each block's own max |x| — rows and cols swapped, or padding counted?")
        assert torch.equal(data, ref.data), f"quantize_blocks {rows}x{cols}: FP8 data differ from the chapter's"
        back = dequantize_blocks(data, scales, rows, cols)
        torch.testing.assert_close(back, dequantize(ref), msg=f"dequantize_blocks {rows}x{cols}: the round trip is "
                                   "off — divide each element by its own block's scale (not multiply)")


def test_ch16_block_outlier_stays_in_its_block(impl: str) -> None:
    quantize_blocks = load(impl, MODULE, "quantize_blocks")
    dequantize_blocks = load(impl, MODULE, "dequantize_blocks")
    torch.manual_seed(2)
    x = torch.randn(32, 32)
    x[3, 4] = 1e5
    data, scales = quantize_blocks(x, 16, 16)
    back = dequantize_blocks(data, scales, 16, 16)
    far = (back[16:, 16:] - x[16:, 16:]).abs() / x[16:, 16:].abs()
    assert float(far.max()) <= 2.0**-4 + 1e-6, ("quantize_blocks: the outlier at (3, 4) spoiled a block it is not "
                                                "in — is each block scaled by its own maximum, not the tensor's?")


def test_ch16_loss_scaler_step(impl: str) -> None:
    step = load(impl, MODULE, "loss_scaler_step")
    grads = [torch.full((3,), 8.0), torch.full((2,), 4.0)]
    take, scale, good = step(grads, 4.0, 0, growth_interval=3)
    assert take and scale == 4.0 and good == 1, f"loss_scaler_step: a clean step gave {(take, scale, good)}"
    assert grads[0].tolist() == [2.0] * 3 and grads[1].tolist() == [1.0] * 2, (
        f"loss_scaler_step: gradients {grads[0].tolist()} after unscaling 8 by 4 — divide by the scale in place")
    take, scale, good = step([torch.ones(2)], 4.0, 2, growth_interval=3)
    assert (take, scale, good) == (True, 8.0, 0), (
        f"loss_scaler_step: the 3rd clean step in a row must double the scale and reset the count, got "
        f"{(take, scale, good)}")
    for bad, what in ((float("inf"), "an inf"), (float("nan"), "a NaN")):
        take, scale, good = step([torch.ones(2), torch.tensor([1.0, bad])], 4.0, 2, growth_interval=3)
        assert (take, scale, good) == (False, 2.0, 0), (
            f"loss_scaler_step: {what} gradient must skip the step, halve the scale, reset the count; got "
            f"{(take, scale, good)}" + (" — inf checks miss NaN: use torch.isfinite" if what == "a NaN" else ""))
