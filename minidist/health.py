"""Trust nothing: cheap checks that catch a broken run at the step it breaks, not hours later.

- `check_finite`: a NaN or inf loss or gradient norm stops training with one line naming the step, before the
  optimizer writes the bad update into the weights.
- `replica_hash`: a fingerprint of tensors' exact bytes. Data-parallel replicas must hold bitwise-identical
  parameters; comparing one short string per rank (chapter 07) finds the first step where they drift apart.
- `check_fp32`: losses are reduced in fp32. A bf16 sum of thousands of per-token losses keeps only 8 bits of
  mantissa, so the logged loss (and its gradient scale) would depend on the batch size and the layout.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

import torch


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm stopped being a finite number."""


def check_finite(step: int, loss: float, grad_norm: float) -> None:
    """Raise TrainingDiverged (one line, naming the step) unless loss and grad_norm are finite."""
    bad = [f"{name}={value}" for name, value in (("loss", loss), ("grad_norm", grad_norm)) if not math.isfinite(value)]
    if bad:
        raise TrainingDiverged(
            f"step {step}: {' and '.join(bad)} is not finite; stopping before the optimizer step "
            "(lower --lr, raise --warmup-steps, or set --grad-clip)"
        )


def check_fp32(name: str, tensor: torch.Tensor) -> None:
    """Raise unless `tensor` is fp32: reductions of losses must not happen in a 16-bit type."""
    if tensor.dtype != torch.float32:
        raise TypeError(f"{name} must be reduced in float32, got {tensor.dtype}")


def replica_hash(tensors: Iterable[torch.Tensor]) -> str:
    """SHA-256 (hex, first 16 characters) of the tensors' raw bytes, in order, with their shapes and dtypes.

    Two replicas agree iff every byte agrees: this is an equality test, not a tolerance test.
    """
    digest = hashlib.sha256()
    for tensor in tensors:
        t = tensor.detach().to("cpu").contiguous()
        digest.update(f"{tuple(t.shape)}{t.dtype};".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]
