"""Trust nothing: cheap checks that catch a broken run at the step it breaks, not hours later.

- `check_finite`: a NaN or inf loss or gradient norm stops training with one line naming the step; the update is
  never written into the weights: `finite_on_device` decides on the device that the optimizer skips it, and the
  trainer reports it when it next reads its figures.
- `replica_hash`: a fingerprint of tensors' exact bytes. Data-parallel replicas must hold bitwise-identical
  parameters; comparing one short string per rank (chapter 07) finds the first step where they drift apart.
(That losses are reduced in fp32 is checked where they are reduced: `minidist.precision.check_fp32`.)
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Iterable

import torch

from minidist.comm import communicator


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


def finite_on_device(loss: torch.Tensor, grad_norm: torch.Tensor, healthy: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """`check_finite`'s test decided on the device, without a host read: a bool tensor, True while `healthy` (the
    steps before; None: none) and this step's loss and grad_norm are finite. The trainer skips the update where it
    is False and calls `check_finite` on the figures when it next reads them."""
    finite = torch.isfinite(loss) & torch.isfinite(grad_norm.to(loss.device))
    return finite if healthy is None else healthy & finite


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



def comm_failure(exc: BaseException) -> str | None:
    """One line for an exception raised inside a collective (a peer that stopped answering within
    --comm-timeout, or died), naming the operation and the group from the outermost `Comm` frame of the
    traceback; None for any other exception (a bug, which keeps its traceback)."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    innermost = os.path.abspath(frames[-1].f_code.co_filename) if frames else ""
    if innermost != os.path.abspath(communicator.__file__) and f"torch{os.sep}distributed" not in innermost:
        return None
    where = "a collective"
    for frame in frames:
        owner = frame.f_locals.get("self")
        if isinstance(owner, communicator.Comm):
            site = _site(owner, owner.last_call[1])
            where = f"{frame.f_code.co_name} over group {owner.name} (ranks {owner.ranks})" + (
                f", called at {site}" if site else "")
            break
        if isinstance(owner, communicator.Handle) and owner.origin is not None:  # an asynchronous call's wait()
            comm, op, seq = owner.origin
            site = _site(comm, seq)
            where = f"waiting for {op} over group {comm.name} (ranks {comm.ranks})" + (f", posted at {site}"
                                                                                        if site else "")
            break
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"{where} failed: {first}"


def _site(comm: communicator.Comm, seq: int | None) -> str | None:
    """Where the call `seq` of `comm` was made, from its flight recorder (None without one)."""
    if comm.recorder is None or seq is None:
        return None
    return next((r["site"] for r in comm.recorder.records() if r["seq"] == seq), None)


def stop_reason(exc: BaseException, rank: int) -> str | None:
    """The one line the trainer prints when it stops a run on purpose (a divergence, replicas that differ, a
    collective that failed); None for anything else."""
    if isinstance(exc, TrainingDiverged):
        return str(exc)
    line = comm_failure(exc)
    return f"rank {rank}: {line}" if line is not None else None
