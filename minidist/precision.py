"""Mixed precision: which dtype a run computes in, and the context its forward passes run in.

`--dtype auto` is bf16 on CUDA (tensor cores: 989 TFLOP/s dense bf16 on an H100 SXM against 67 TFLOP/s fp32 without
tensor cores, NVIDIA H100 datasheet) and fp32 on a CPU (where bf16 matmuls are emulated or slow on most chips).

Under bf16 only the compute is bf16: `torch.autocast` casts the inputs of matmuls to bf16 and keeps the weights,
their gradients, the optimizer state (AdamW moments) and every gradient reduction in fp32 ("master weights",
Micikevicius et al. 2018, Mixed Precision Training, §3.1). The losses are computed in fp32 (`lm_loss` upcasts the
logits). bf16 has fp32's exponent range, so no loss scaling is needed (Kalamkar et al. 2019).

fp32 matmuls on CUDA may use TF32 tensor cores (10-bit mantissa inputs, fp32 accumulation), the choice
`torch.set_float32_matmul_precision("high")` makes. It is set through that call, not through the per-backend
`fp32_precision` switches alone: inductor reads `torch.get_float32_matmul_precision()`, which raises on a mix of the
two APIs. The call also sets oneDNN's CPU matmuls to TF32; that one switch is put back, so a CPU keeps exact fp32.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

DTYPES = ("auto", "fp32", "bf16")


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """'auto' -> 'bf16' on CUDA, 'fp32' elsewhere; 'fp32' and 'bf16' as given."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is unknown; choose one of {DTYPES}")
    if dtype == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return dtype


def configure_matmuls(device: torch.device) -> None:
    """Allow TF32 for fp32 matmuls and convolutions on CUDA (cuBLAS and cuDNN); leave CPU settings alone: a run
    on a CPU changes nothing, and a CUDA run keeps its CPU matmuls (oneDNN's) in exact fp32."""
    if device.type == "cuda":
        cpu = torch.backends.mkldnn.matmul.fp32_precision
        torch.set_float32_matmul_precision("high")  # both APIs agree: get_float32_matmul_precision() answers
        torch.backends.mkldnn.matmul.fp32_precision = cpu


def autocast_for(dtype: str, device: torch.device) -> Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context the forward pass runs in: bf16 autocast, or nothing for fp32 (dtype resolved)."""
    if dtype == "bf16":
        return functools.partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def check_fp32(name: str, tensor: torch.Tensor) -> None:
    """Raise unless `tensor` is fp32: reductions of losses must not happen in a 16-bit type. A bf16 sum of
    thousands of per-token losses keeps only 8 bits of mantissa, so the logged loss (and its gradient scale)
    would depend on the batch size and the layout."""
    if tensor.dtype != torch.float32:
        raise TypeError(f"{name} must be reduced in float32, got {tensor.dtype}")


@dataclass(frozen=True)
class CommPrecision:
    """The dtypes data parallelism communicates in: one policy, read by the engines, the ledger's bytes and the
    byte formulas (`zero_comm_bytes`). The FP8 chapter adds its gathers here.

    reduce_dtype: gradient buckets, summed over micro-batches and replicas and rounded once (fp32: a bf16 sum of
    many replicas' gradients loses the small ones).
    gather_dtype: ZeRO-3's parameter all-gathers, once per micro-batch for the forward and again for the backward.
    bf16 halves those bytes, the largest traffic of ZeRO-3; the cost: the weights a forward sees are bf16-rounded
    (under bf16 autocast the matmuls round them anyway, but norms and the embedding now see bf16 weights too) and
    their gradients arrive in bf16 (summed into fp32 buckets). The shards the optimizer updates stay fp32.
    """

    reduce_dtype: torch.dtype = torch.float32
    gather_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("reduce_dtype", "gather_dtype"):
            if not getattr(self, name).is_floating_point:
                raise TypeError(f"CommPrecision.{name} must be a floating dtype, got {getattr(self, name)}")


FP32_COMM = CommPrecision()  # every default: parity with one device, chapter 07's figures


class DynamicLossScaler:
    """Loss scaling for fp16 (Micikevicius et al. 2018, Mixed Precision Training, §3.2): fp16's smallest subnormal is
    2^-24 ≈ 6e-8, and small gradients flush to zero. Multiply the loss by S (so every gradient is S times larger),
    divide the gradients by S in fp32 before the step. S is searched for: halve it and skip the step when a gradient
    overflows (inf/NaN), double it after `growth_interval` clean steps. bf16 has fp32's exponent range: no scaler.

    The check reads one flag on the host per step: a teaching scaler; `torch.amp.GradScaler` fuses it."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000) -> None:
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1 and init_scale > 0):
            raise ValueError("need growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1, init_scale > 0")
        self.scale, self.growth_factor, self.backoff_factor = init_scale, growth_factor, backoff_factor
        self.growth_interval, self.good_steps, self.skipped = growth_interval, 0, 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale

    def unscale_(self, params: list[torch.nn.Parameter]) -> bool:
        """Divide every gradient by the scale (in place); True when any is inf or NaN (the step must be skipped)."""
        grads = [p.grad for p in params if p.grad is not None]
        for grad in grads:
            grad.div_(self.scale)
        return bool(torch.stack([~torch.isfinite(g).all() for g in grads]).any()) if grads else False  # one read

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps, self.skipped = 0, self.skipped + 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def step(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> bool:
        """Unscale, step unless a gradient overflowed, update the scale. Returns whether the step was taken."""
        found_inf = self.unscale_(params)
        if not found_inf:
            optimizer.step()
        self.update(found_inf)
        return not found_inf
