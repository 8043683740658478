"""FP8 numbers: the formats derived from their bit fields, and scaled, saturating quantization at four granularities.

A binary float with e exponent bits and m mantissa bits has bias 2^(e-1) - 1, spacing 2^-m relative to the leading
power of two, smallest normal 2^(1-bias) and smallest subnormal 2^(1-bias-m). IEEE formats (fp32, bf16, fp16, e5m2)
keep the top exponent for inf/NaN; e4m3fn (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", §3) drops the
infinities and keeps only S.1111.111 as NaN, buying one more binade: max 1.75 · 2^8 = 448 instead of 240.

FP8 has so few bits that a tensor must be scaled into the format's range before the cast: x_q = sat(x · s) with
s = max_fp8 / amax, and x ≈ x_q / s. Where the amax is taken decides what one outlier costs: over the whole tensor
(per-tensor), over one row (per-row, along the contraction dimension of the matmul that consumes it), over 1×b tiles
(DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.3.2: 1×128 for activations) or b×b blocks (128×128 for
weights). Scales are kept in the compact shape of their granularity; `dequantize` expands them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
GRANULARITIES = ("tensor", "row", "tile", "block")
AMAX_FLOOR = 1e-12  # an all-zero tensor gets a finite scale (torchao uses the same floor)


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format from its bit fields; every figure derived, none looked up."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    ieee_special: bool = True  # the top exponent is inf/NaN (False: e4m3fn, where only all-ones is NaN)

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def max(self) -> float:
        top = 2**self.exponent_bits - 1 - self.bias  # the all-ones exponent field, unbiased
        if self.ieee_special:  # the top exponent is taken: the largest is 1.11...1 at the one below
            return (2 - 2.0**-self.mantissa_bits) * 2.0 ** (top - 1)
        return (2 - 2.0 ** (1 - self.mantissa_bits)) * 2.0**top  # all-ones mantissa there is NaN

    @property
    def smallest_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa_bits)

    @property
    def eps(self) -> float:
        """The spacing of numbers in [1, 2): one unit in the last place of 1.0."""
        return 2.0**-self.mantissa_bits


FORMATS = {f.name: f for f in (FloatFormat("fp32", 8, 23), FloatFormat("tf32", 8, 10), FloatFormat("bf16", 8, 7),
                               FloatFormat("fp16", 5, 10), FloatFormat("e4m3", 4, 3, ieee_special=False),
                               FloatFormat("e5m2", 5, 2))}
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": E4M3, "e5m2": E5M2}


def fp8_max(dtype: torch.dtype) -> float:
    if dtype not in (E4M3, E5M2):
        raise TypeError(f"{dtype} is not an FP8 format; use torch.float8_e4m3fn or torch.float8_e5m2")
    return FORMATS["e4m3" if dtype == E4M3 else "e5m2"].max


@dataclass(frozen=True)
class Quantized:
    """FP8 values and the scales they were multiplied by (x ≈ data / scale), in their granularity's shape:
    tensor (), row (rows, 1), tile (rows, ⌈cols/b⌉), block (⌈rows/b⌉, ⌈cols/b⌉)."""

    data: torch.Tensor
    scale: torch.Tensor
    granularity: str
    block: int


def _blocks(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x (2-D), zero-padded to whole blocks, viewed as (row blocks, rows, col blocks, cols)."""
    pad_r, pad_c = -x.shape[0] % rows, -x.shape[1] % cols
    padded = F.pad(x, (0, pad_c, 0, pad_r))
    return padded.view(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)


def _block_shape(granularity: str, block: int) -> tuple[int, int]:
    return (1, block) if granularity == "tile" else (block, block)


def amax(x: torch.Tensor, granularity: str, block: int = 128) -> torch.Tensor:
    """max |x| over each scaling group of a 2-D tensor (fp32), in the compact shape of `granularity`."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity {granularity!r} is unknown; choose one of {GRANULARITIES}")
    if x.dim() != 2:
        raise ValueError(f"quantize a 2-D tensor (rows, contraction), got shape {tuple(x.shape)}")
    if granularity == "tensor":  # from the extremes: no |x| tensor of x's size
        low, high = torch.aminmax(x.detach().float())
        return torch.maximum(-low, high)
    a = x.detach().abs().float()
    if granularity == "row":
        return a.amax(dim=1, keepdim=True)
    return _blocks(a, *_block_shape(granularity, block)).amax(dim=(1, 3))


def scale_from_amax(amax_: torch.Tensor, dtype: torch.dtype, power_of_2: bool = False) -> torch.Tensor:
    """s = max_fp8 / amax, computed in fp64 and rounded once to fp32 (so a scale does not depend on how the
    division was fused); optionally rounded down to a power of two (then x · s is exact in any binary format)."""
    scale = (fp8_max(dtype) / amax_.double().clamp(min=AMAX_FLOOR)).float()
    return torch.exp2(torch.floor(torch.log2(scale))) if power_of_2 else scale


def expand_scale(scale: torch.Tensor, granularity: str, block: int, shape: torch.Size) -> torch.Tensor:
    """A scale of the compact shape broadcast back to one value per element of a tensor of `shape`."""
    if granularity in ("tensor", "row"):
        return scale
    rows, cols = _block_shape(granularity, block)
    full = scale.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)
    return full.narrow(0, 0, shape[0]).narrow(1, 0, shape[1])  # narrow, not [:, :]: fake CUDA tensors take it


def saturate_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast to FP8, clamping to ±max first: a value past the range becomes max, never NaN or inf."""
    limit = fp8_max(dtype)
    return x.clamp(-limit, limit).to(dtype)


def _scaled_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """saturate_cast(x · scale) with one temporary: the product clamped in place."""
    limit = fp8_max(dtype)
    return (x.float() * scale).clamp_(-limit, limit).to(dtype)


def quantize(x: torch.Tensor, dtype: torch.dtype = E4M3, granularity: str = "tensor", block: int = 128,
             power_of_2: bool = False, reduce_amax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Quantized:
    """Scale a 2-D tensor group by group into `dtype`'s range and cast with saturation. `reduce_amax` (e.g. a MAX
    all-reduce over the ranks holding the other parts of each group) sees the maxima before they become scales."""
    groups = amax(x, granularity, block)
    if reduce_amax is not None:
        groups = reduce_amax(groups)
    scale = scale_from_amax(groups, dtype, power_of_2)
    data = _scaled_cast(x, expand_scale(scale, granularity, block, x.shape), dtype)
    return Quantized(data, scale, granularity, block)


def dequantize(q: Quantized) -> torch.Tensor:
    """The fp32 value an FP8 tensor stands for: data / scale, group by group."""
    return q.data.float() / expand_scale(q.scale, q.granularity, q.block, q.data.shape)


def snr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 10 log10(Σ ref² / Σ (ref - approx)²) (host read: eval only)."""
    ref = reference.double()
    noise = (ref - approx.double()).pow(2).sum()
    return float(10 * torch.log10(ref.pow(2).sum() / noise.clamp(min=1e-300)))
