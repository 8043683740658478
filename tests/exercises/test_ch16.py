"""Grade chapter 16's exercises: a saturating per-tensor e4m3 quantizer, the block quantizer and its inverse, the
FP8 linear's three GEMMs scaled along their own contraction axes, and a dynamic loss scaler's step.

`pytest tests/exercises -k ch16` grades solutions/ (the default); add `--impl exercises` to grade your own answers
(`make grade CH=16`). The oracles: torch.finfo, the package's quantizer (`minidist.model.fp8.quantize`, checked
against torchao in tests/test_fp8.py), and gradients built here with a known overflow.
"""

import math

import torch
from grading import load

from minidist.model.fp8 import E4M3, quantize

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


def _block_oracle(x: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales (448 / each rows x cols block's max |x|, partial blocks at the edges) and the e4m3 data, built here."""
    grid = (math.ceil(x.shape[0] / rows), math.ceil(x.shape[1] / cols))
    amax = torch.zeros(grid, dtype=torch.float64)
    for i in range(grid[0]):
        for j in range(grid[1]):
            amax[i, j] = x[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols].abs().max().double()
    scales = (448.0 / amax.clamp(min=1e-12)).float()
    spread = scales.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: x.shape[0], : x.shape[1]]
    return (x * spread).clamp(-448, 448).to(E4M3), scales


def _mixed_view_scales(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The scales of a plausible slip: the padded tensor viewed with rows and cols exchanged inside each block."""
    padded = torch.nn.functional.pad(x.abs(), (0, -x.shape[1] % cols, 0, -x.shape[0] % rows))
    amax = padded.reshape(padded.shape[0] // rows, cols, padded.shape[1] // cols, rows).amax(dim=(1, 3))
    return (448.0 / amax.double().clamp(min=1e-12)).float()


def _block_cause(x: torch.Tensor, rows: int, cols: int, got: torch.Tensor) -> str:
    """Name the likely cause of wrong block scales by matching them with plausible wrong answers."""
    want = _block_oracle(x, rows, cols)[1]
    if tuple(got.shape) == (math.ceil(x.shape[0] / cols), math.ceil(x.shape[1] / rows)) and rows != cols:
        return "rows and cols swapped: `rows` counts along dim 0 (the block's height), `cols` along dim 1"
    if tuple(got.shape) == (x.shape[0] // rows, x.shape[1] // cols):
        return "the partial blocks at the edges are missing: ⌈R/rows⌉ x ⌈C/cols⌉ blocks (pad with zeros)"
    if tuple(got.shape) != tuple(want.shape):
        return f"expected shape {tuple(want.shape)}"
    if torch.allclose(got, 1 / want, rtol=1e-5):
        return "the scale is 448 / amax, not amax / 448"
    if torch.allclose(got, torch.full_like(want, 448.0 / float(x.abs().max())), rtol=1e-5):
        return "every block got the whole tensor's scale: take each block's own max |x|"
    if rows != cols and torch.allclose(got, _mixed_view_scales(x, rows, cols), rtol=1e-5):
        return ("the padded tensor was viewed as (R/rows, cols, C/cols, rows): each group mixes elements of "
                "different blocks; view it as (R/rows, rows, C/cols, cols)")
    return "they differ from 448 / each block's own max |x|"


def test_ch16_quantize_blocks(impl: str) -> None:
    quantize_blocks = load(impl, MODULE, "quantize_blocks")
    dequantize_blocks = load(impl, MODULE, "dequantize_blocks")
    torch.manual_seed(1)
    x = torch.randn(40, 72)  # not whole blocks: the last row and column of blocks are partial
    x[:, 70] *= 50  # an outlier column in the last, partial column of blocks
    # non-square blocks tell rows from cols; 16x16 and 1x16 are the chapter's blocks and tiles
    for rows, cols in ((16, 16), (1, 16), (8, 24), (24, 8)):
        data, scales = quantize_blocks(x, rows, cols)
        want_data, want_scales = _block_oracle(x, rows, cols)
        ok = tuple(scales.shape) == tuple(want_scales.shape) and torch.allclose(scales, want_scales, rtol=1e-6)
        assert ok, f"quantize_blocks {rows}x{cols}: scales of shape {tuple(scales.shape)} — " + _block_cause(
            x, rows, cols, scales)
        assert torch.equal(data, want_data), (f"quantize_blocks {rows}x{cols}: the scales are right but the FP8 "
                                              "data differ — multiply each element by its own block's scale")
        back = dequantize_blocks(data, scales, rows, cols)
        want_back = want_data.float() / want_scales.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[:40, :72]
        torch.testing.assert_close(back, want_back, msg=f"dequantize_blocks {rows}x{cols}: the round trip is off — "
                                   "divide each element by its own block's scale (not multiply), rows along dim 0")
    for rows, cols, granularity in ((16, 16, "block"), (1, 16, "tile")):  # the chapter's quantizer agrees
        assert torch.equal(quantize_blocks(x, rows, cols)[0], quantize(x, E4M3, granularity, block=16).data), (
            f"quantize_blocks {rows}x{cols}: differs from the chapter's quantizer")


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


# ---------------------------------------------------------------------------------------------------------------
# The FP8 linear: three GEMMs, each operand scaled along its own GEMM's contraction
# ---------------------------------------------------------------------------------------------------------------


def _q(t: torch.Tensor, dim: int | None, dtype: torch.dtype = E4M3) -> torch.Tensor:
    """t quantized with one scale per slice along `dim` (None: one for the tensor), dequantized."""
    limit = torch.finfo(dtype).max
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = (limit / amax.double().clamp(min=1e-12)).float()
    return (t * scale).clamp(-limit, limit).to(dtype).float() / scale


# For each GEMM: the right axes (the contraction's), then plausible wrong answers and the cause each one shows.
_GEMMS = {
    "y": ("forward y = x·Wᵀ (contracts over K)", lambda x, w, dy, a, b: _q(x, a) @ _q(w, b).t(), (1, 1), {
        (0, 1): "x scaled per feature (amax over the tokens): the forward contracts over K, so x needs one scale "
                "per token, its amax over K (dim -1)",
        (1, 0): "W scaled per column (amax over N): the forward contracts over K, so W needs one scale per output "
                "row, its amax over K",
        (None, None): "one scale per tensor: the rowwise recipe has one per row along each GEMM's contraction"}),
    "dx": ("input gradient dx = dy·W (contracts over N)", lambda x, w, dy, a, b: _q(dy, a) @ _q(w, b), (1, 0), {
        (1, 1): "W scaled per row over K, the forward's quantized W reused: dx = dy·W contracts over N, so W needs "
                "one scale per column (amax over N, dim 0)",
        (0, 0): "dy scaled per feature (amax over the tokens): dx contracts over N, so dy needs one scale per "
                "token, its amax over N",
        (0, 1): "both operands scaled along the wrong axis: dx contracts over N (dy's amax over N, W's over N)",
        (None, None): "one scale per tensor: the rowwise recipe has one per row along each GEMM's contraction"}),
    "dw": ("weight gradient dW = dyᵀ·x (contracts over the tokens)", lambda x, w, dy, a, b: _q(dy, a).t() @ _q(x, b),
           (0, 0), {
        (0, 1): "x scaled per token over K, the forward's quantized x reused: dW contracts over the M tokens, so x "
                "needs one scale per input feature (amax over the tokens, dim 0)",
        (1, 0): "dy scaled per token over N, the input gradient's quantized dy reused: dW contracts over the "
                "tokens, so dy needs one scale per output feature (amax over the tokens)",
        (1, 1): "both operands scaled per token: dW contracts over the tokens, so each needs its amax over them",
        (None, None): "one scale per tensor: the rowwise recipe has one per row along each GEMM's contraction"}),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _fp8_linear_cause(name: str, got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor) -> str:
    _, gemm, right, wrong = _GEMMS[name]
    exact = {"y": x @ w.t(), "dx": dy @ w, "dw": dy.t() @ x}[name]
    if _rel(got, exact) < 1e-6:
        return "it equals the fp32 product: quantize both operands to e4m3 first"
    for axes, cause in wrong.items():
        if _rel(got, gemm(x, w, dy, *axes)) < 1e-4:
            return cause
    if name != "y":
        with_e5m2 = {"dx": _q(dy, 1, torch.float8_e5m2) @ _q(w, 0),
                     "dw": _q(dy, 0, torch.float8_e5m2).t() @ _q(x, 0)}[name]
        if _rel(got, with_e5m2) < 1e-4:
            return "dy was cast to e5m2: the rowwise recipe keeps e4m3 for the gradient too"
    if _rel(got, exact) > 0.5:
        return "far from the product itself: dequantize by dividing by the scale (data.float() / scale)"
    return "check each operand's axis: the amax runs along the index the GEMM sums over"


def test_ch16_fp8_linear_rowwise(impl: str) -> None:
    fp8_linear = load(impl, MODULE, "fp8_linear_rowwise")
    gen = torch.Generator().manual_seed(16)
    m_shape, k, n = (2, 18), 40, 24  # M = 36 tokens, K = 40, N = 24: three contractions of different lengths
    x = torch.randn(*m_shape, k, generator=gen)
    x[..., 3] *= 60  # an outlier input channel (LLM.int8()'s kind): wrong axes show
    w = torch.randn(n, k, generator=gen) * 0.1
    w[5] *= 30  # an outlier output row
    dy = torch.randn(*m_shape, n, generator=gen)
    dy[0, 7] *= 80  # one token with a large gradient
    y, dx, dw = fp8_linear(x.clone(), w.clone(), dy.clone())
    assert y.shape == (*m_shape, n) and dx.shape == x.shape and dw.shape == w.shape, (
        f"fp8_linear_rowwise: shapes {tuple(y.shape)}, {tuple(dx.shape)}, {tuple(dw.shape)}; expected y "
        f"{(*m_shape, n)}, dx like x {tuple(x.shape)}, dW like the weight {tuple(w.shape)}")
    x2, dy2 = x.reshape(-1, k), dy.reshape(-1, n)
    for name, got in (("y", y.reshape(-1, n)), ("dx", dx.reshape(-1, k)), ("dw", dw)):
        what, gemm, right, _ = _GEMMS[name]
        want = gemm(x2, w, dy2, *right)
        assert _rel(got, want) < 1e-5, (f"fp8_linear_rowwise: the {what} is off by {_rel(got, want):.1%} — "
                                         + _fp8_linear_cause(name, got.float(), x2, w, dy2))
