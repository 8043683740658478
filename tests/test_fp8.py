"""FP8 (chapter 16): the formats against torch.finfo and exhaustive casts, the saturating quantizer at four
granularities, the FP8 linear against the high-precision layer (a tolerance derived from the formats' mantissas),
against torchao's tensorwise and rowwise recipes (the oracle: the same scales, outputs and gradients) and blockwise
against an fp64 reference; the dynamic loss scaler on fp16."""

import collections
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from minidist.model.fp8 import (
    E4M3,
    E5M2,
    FORMATS,
    TORCH_DTYPES,
    dequantize,
    expand_scale,
    quantize,
    saturate_cast,
    snr_db,
)
from minidist.model.fp8_linear import Fp8Recipe, linear
from minidist.precision import DynamicLossScaler


def rms_rounding_error(mantissa_bits: int) -> float:
    """The rms relative error of rounding to nearest with m mantissa bits, for values spread log-uniformly within a
    binade: the error is uniform on ±ulp/2 with ulp = 2^-m · 2^e, so rms = 2^-m/√12 · √E[1/v²], v log-uniform on
    [1, 2): E[1/v²] = (1/ln 2) ∫₁² v⁻³ dv = 3/(8 ln 2)."""
    return 2.0**-mantissa_bits / math.sqrt(12) * math.sqrt(3 / (8 * math.log(2)))


def predicted_gemm_error(a_bits: int, b_bits: int) -> float:
    """A dot product of many terms whose two factors carry independent relative errors δa, δb: the relative error
    of the sum is √(δa² + δb²) (errors of independent terms add in quadrature, like the signal)."""
    return math.hypot(rms_rounding_error(a_bits), rms_rounding_error(b_bits))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16", "e4m3", "e5m2"])
def test_formats_are_derived_from_their_bits(name):
    fmt, info = FORMATS[name], torch.finfo(TORCH_DTYPES[name])
    assert (fmt.max, fmt.smallest_normal, fmt.eps) == (info.max, info.tiny, info.eps), name
    sub = torch.tensor([fmt.smallest_subnormal, fmt.smallest_subnormal / 2], dtype=torch.float64)
    assert sub.to(TORCH_DTYPES[name]).double().tolist() == [fmt.smallest_subnormal, 0.0], "half of it ties to 0"


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_every_fp8_bit_pattern(name):
    """All 256 codes: the finite ones are exactly ±(the derived grid), the largest is the derived max."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(TORCH_DTYPES[name]).float()
    finite = values[torch.isfinite(values)]
    fmt = FORMATS[name]
    assert float(finite.max()) == fmt.max and float(finite.min()) == -fmt.max
    assert float(finite[finite > 0].min()) == fmt.smallest_subnormal
    nan_codes = int(torch.isnan(values).sum())
    assert nan_codes == (2 if name == "e4m3" else 6), "e4m3fn: only S.1111.111 is NaN; e5m2: IEEE (2·3 NaNs)"


def test_saturating_cast_never_makes_nan_or_inf():
    x = torch.tensor([1e6, -1e6, 448.0, 500.0, 0.0])
    q = saturate_cast(x, E4M3).float()
    assert q.tolist() == [448.0, -448.0, 448.0, 448.0, 0.0]
    assert saturate_cast(torch.tensor([1e9]), E5M2).float().item() == FORMATS["e5m2"].max


@pytest.mark.parametrize("granularity", ["tensor", "row", "tile", "block"])
def test_quantize_round_trip_error_is_half_an_ulp(granularity):
    """Within a scaling group every normal value comes back within half an e4m3 ulp (2^-4 relative), and the
    group's largest value maps to exactly ±448; the last tile/block is partial (shapes not multiples of 16)."""
    torch.manual_seed(0)
    x = torch.randn(40, 72) * torch.logspace(-2, 2, 72)
    q = quantize(x, E4M3, granularity, block=16)
    back = dequantize(q)
    scaled = x.abs() * expand_scale(q.scale, granularity, 16, x.shape)
    is_normal = scaled >= FORMATS["e4m3"].smallest_normal  # subnormals have coarser relative steps
    err = ((back - x).abs() / x.abs())[is_normal]
    assert float(err.max()) <= 2.0**-4 + 1e-7, granularity
    assert float(q.data.float().abs().max()) == 448.0


def test_block_scales_confine_an_outlier_to_its_block():
    """One 1e5 outlier: per-tensor scaling (s = 448/1e5) pushes unit values to ~0.0045, e4m3's subnormals
    (spacing 2^-9): the SNR of every other element collapses; with 16×16 blocks only the outlier's block does."""
    torch.manual_seed(0)
    x = torch.randn(64, 64)
    x[5, 7] = 1e5
    outside = torch.ones_like(x, dtype=torch.bool)
    outside[:16, :16] = False
    snr = {g: snr_db(x[outside], dequantize(quantize(x, E4M3, g, block=16))[outside]) for g in ("tensor", "block")}
    assert snr["block"] > 30 and snr["tensor"] < snr["block"] - 10, snr
    assert quantize(x, E4M3, "block", block=16).scale.shape == (4, 4)
    assert quantize(x, E4M3, "tile", block=16).scale.shape == (64, 4)


class CountScaledMM(TorchDispatchMode):
    """Counts the FP8 GEMMs (the `minidist::fp8_gemm` operator, one per GEMM whatever runs it) and, in `kernels`,
    which kernel ran each."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.kernels = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.minidist.fp8_gemm.default:
            self.calls += 1
            self.kernels[args[7]] += 1
        return func(*args, **(kwargs or {}))


CPU_KERNEL = {"tensorwise": "dequantized_mm", "rowwise": "scaled_mm", "blockwise": "dequantized_mm"}


def _linear_run(recipe, x, w, g):
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = linear(x, w, None, recipe) if recipe else F.linear(x, w)
    y.backward(g)
    return y.detach(), x.grad, w.grad


@pytest.mark.parametrize("recipe,grad_bits", [("tensorwise", 2), ("rowwise", 3), ("blockwise", 3)])
def test_fp8_linear_error_matches_the_derived_figure(recipe, grad_bits):
    """Output, input and weight gradients against fp32: relative error within [0.6, 1.5]× the figure derived from
    the mantissas (√2 · δ(e4m3) forward; the gradient GEMMs hold one gradient operand: e5m2 under tensorwise).
    The lower bound is the check that the GEMMs really ran in FP8."""
    torch.manual_seed(0)
    x, w = torch.randn(3, 48, 96), torch.randn(80, 96) * 0.05
    g = torch.randn(3, 48, 80)
    ref = _linear_run(None, x, w, g)
    with CountScaledMM() as count:
        got = _linear_run(Fp8Recipe(recipe, block=32), x, w, g)
    want = [predicted_gemm_error(3, 3)] + [predicted_gemm_error(grad_bits, 3)] * 2
    for name, a, b, bound in zip(("output", "grad_input", "grad_weight"), got, ref, want):
        assert 0.6 * bound < relative(a, b) < 1.5 * bound, (recipe, name, relative(a, b), bound)
    assert count.kernels == {CPU_KERNEL[recipe]: 3}, "one FP8 GEMM per GEMM, by the CPU's kernel"


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_linear_matches_torchao(recipe):
    """torchao's Float8Linear (the oracle) on the same inputs, bit for bit: tensorwise (on a CPU ours is the
    dequantized fp32 matmul, torchao's the CPU's `_scaled_mm`), and rowwise (both one `_scaled_mm` with row scales,
    written in bf16)."""
    pytest.importorskip("torchao")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax
    torch.manual_seed(1)
    oracle = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=False))
    w = oracle[0].weight.detach().clone()
    convert_to_float8_training(oracle, config=Float8LinearConfig.from_recipe_name(recipe))
    x, g = torch.randn(32, 64), torch.randn(32, 48)
    xo = x.clone().requires_grad_()
    yo = oracle(xo)
    yo.backward(g)
    got = _linear_run(Fp8Recipe(recipe), x, w, g)
    rtol = 0.0
    for a, b in zip(got, (yo.detach(), xo.grad, oracle[0].weight.grad)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()))
    if recipe == "rowwise":  # the same scales: per row of x, power-of-two rounded
        want = amax_to_scale(tensor_to_amax(x, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1),
                             E4M3, round_scales_to_power_of_2=True)
        assert torch.equal(quantize(x, E4M3, "row", power_of_2=True).scale, want)


def test_blockwise_against_fp64_reference():
    """The K-chunked blockwise GEMM equals the fp64 product of the dequantized operands (fp32 accumulation:
    rtol 1e-5): the emulation adds nothing but fp32 rounding to the FP8 quantization itself."""
    torch.manual_seed(2)
    x, w = torch.randn(20, 100), torch.randn(36, 100)
    xq, wq = quantize(x, E4M3, "tile", block=32), quantize(w, E4M3, "block", block=32)
    from minidist.model.fp8_linear import scaled_matmul

    want = dequantize(xq).double() @ dequantize(wq).double().t()
    torch.testing.assert_close(scaled_matmul(xq, wq).double(), want, rtol=1e-5, atol=1e-5)


def test_loss_scaler_on_fp16():
    """fp16 gradients of 1e-8 flush to zero unscaled; scaled by 2^15 they survive and unscale to the fp32 value. An
    overflowing step is skipped and the scale halves; growth_interval clean steps double it."""
    w = torch.nn.Parameter(torch.ones(4))  # the fp32 master weight; the model computes with its fp16 copy
    x = torch.full((4,), 1e-4, dtype=torch.float16)

    def loss():  # dloss/dw16 = 1e-4 · 1e-4 = 1e-8, computed in fp16
        return (w.half() * x).sum() * 1e-4

    loss().backward()
    assert float(w.grad.abs().max()) == 0.0, "1e-8 is below fp16's smallest subnormal 6e-8"
    w.grad = None
    scaler = DynamicLossScaler(init_scale=2.0**15, growth_interval=2)  # 2^16 itself is past fp16's max, 65504
    opt = torch.optim.SGD([w], lr=0.0)
    scaler.scale_loss(loss()).backward()
    assert scaler.step(opt, [w]) and float(w.grad[0]) == pytest.approx(1e-8, rel=1e-2)
    w.grad = None
    scaler.scale_loss((w.half() * 60000.0).sum()).backward()  # 60000 · 2^15 overflows fp16
    assert not scaler.step(opt, [w]) and scaler.scale == 2.0**14 and scaler.skipped == 1
    for _ in range(2):
        w.grad = torch.zeros_like(w)
        scaler.step(opt, [w])
    assert scaler.scale == 2.0**15


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_fp8_linear_makes_every_tensor_on_its_device(recipe):
    """Under the device sentinel (a tensor made without device= is meta and fails at its first use) the FP8
    linear's forward and backward run: every scale and constant is made on the input's device."""
    from device_sentinel import device_sentinel

    x, w = torch.randn(16, 64, device="cpu"), torch.randn(32, 64, device="cpu")
    g = torch.randn(16, 32, device="cpu")
    with device_sentinel():
        got = _linear_run(Fp8Recipe(recipe, block=32), x, w, g)
    assert all(t.device.type == "cpu" and torch.isfinite(t).all() for t in got)


def test_mfu_divides_by_the_fp8_peak():
    """--fp8 on a datasheet chip: the dense FP8 peak (twice bf16 on an H100/H200 SXM); on a CPU, with no FP8 units,
    the measured fp32 matmul peak, labelled as such."""
    from minidist import flops, hardware
    from minidist.model.config import get_preset

    for chip in ("H100-SXM", "H200-SXM"):
        fp8, bf16 = hardware.peak_flops(chip, "fp8"), hardware.peak_flops(chip)
        assert fp8 == 1979e12 and 1.99 < fp8 / bf16 < 2.01
    peak, source = flops.peak_for_device(torch.device("cpu"), "fp8", None, get_preset("tiny"), 64, min_seconds=0.01)
    assert peak > 0 and "measured cpu fp32 matmul peak" in source


@pytest.mark.parametrize("recipe", ["tensorwise", "blockwise"])
def test_a_zero_bubble_split_runs_each_fp8_backward_gemm_once(recipe):
    """A zero-bubble pipeline splits the backward into B (input gradients) and W (weight gradients). An FP8 linear
    is one custom autograd node, which would compute dX and dW in B and both again in W; told its phase, B runs the
    dX GEMM(s) only and W the dW GEMM(s) only: together the fused backward's count, with its gradients bit for bit."""
    from minidist.parallel.pp.split_backward import backward_input, backward_weight

    g = torch.Generator().manual_seed(0)
    x0, w1, w2 = (torch.randn(*shape, generator=g) for shape in ((64, 32), (48, 32), (32, 48)))
    grad = torch.randn(64, 32, generator=g)
    fp8 = Fp8Recipe(recipe, block=16)

    def run(split: bool) -> tuple[list[int], torch.Tensor, list[torch.Tensor]]:
        x, a, b = x0.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()
        y = linear(torch.relu(linear(x, a, None, fp8)), b, None, fp8)  # two FP8 linears, one chunk
        with CountScaledMM() as count:
            if split:
                (dx,), work = backward_input([y], [grad], [x])
                calls = [count.calls]
                backward_weight(work)
            else:
                y.backward(grad)
                dx, calls = x.grad, []
        return calls + [count.calls], dx, [a.grad, b.grad]

    (fused,), dx, dw = run(split=False)
    (in_b, total), dx_split, dw_split = run(split=True)
    assert total == fused == 4 and in_b == 2, (recipe, in_b, total, fused)  # dX in B, dW in W: no GEMM twice
    torch.testing.assert_close(dx_split, dx, rtol=0, atol=0)
    for got, want in zip(dw_split, dw):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
