"""Chapter 19: the attention kernel — FlashAttention-2 forward and backward written in Triton.

`flash.py` is the operator (`flash_attention`, `flash_attention_with_lse`), `flash_forward.py` and
`flash_backward.py` its kernels, `core.py` the attention core the trainer swaps in (`--attention-kernel triton`).
This package sits at the bottom of the import direction: it imports torch and triton, nothing of minidist above it.

Importing this package does not import Triton (a run with SDPA needs none installed); `flash` and `core` do. On a
CPU the kernels run under Triton's interpreter, which Triton chooses when `@triton.jit` decorates a kernel: the
environment must hold TRITON_INTERPRET=1 before `minidist.kernels.flash` is first imported (Triton's convention).
`unavailable` says, in one line, why the kernels cannot run on a device.
"""

from __future__ import annotations

import importlib.util
import sys

ATTENTION_KERNELS = ("sdpa", "triton")  # --attention-kernel: the model's SDPA core, or this package's
HOW = "TRITON_INTERPRET=1 python -m minidist.train --attention-kernel triton ..."


def interpreted() -> bool | None:
    """Whether the kernels were decorated for Triton's interpreter: True or False once they are imported
    (`minidist.kernels.flash`), None before (then the environment at that import decides)."""
    flash = sys.modules.get("minidist.kernels.flash_forward")
    if flash is None:
        return None
    return type(flash._forward_kernel).__name__ == "InterpretedFunction"


def unavailable(device_type: str) -> str | None:
    """None when the Triton kernels can run on `device_type` ("cuda" or "cpu"), else the reason and the way out in
    one line."""
    if importlib.util.find_spec("triton") is None:
        return "--attention-kernel triton needs Triton: pip install -e '.[kernels]'"
    if device_type == "cuda":
        return None
    decorated = interpreted()
    if decorated is None:
        from triton import knobs  # Triton's own reading of TRITON_INTERPRET, the one @triton.jit will ask

        decorated = bool(knobs.runtime.interpret)
    if not decorated:
        return (f"--attention-kernel triton on a {device_type} runs under Triton's interpreter, which Triton "
                f"chooses when the kernels are imported: start the process with it set, e.g. {HOW}")
    if device_type != "cpu":
        return f"--attention-kernel triton runs on cuda (or a cpu under TRITON_INTERPRET=1), not {device_type}"
    return None
