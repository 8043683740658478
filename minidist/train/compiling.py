"""--compile: `torch.compile` of every transformer block, and the one check it needs before a run starts.

Each block is compiled in place (`nn.Module.compile`: the module, its name and its parameters stay; its call goes
through the compiled code), not the whole model: the blocks are where the time goes, they are identical in
structure so one graph serves them all, and the layout transformations (tensor, expert, pipeline parallel) keep
blocks whole. A collective inside a block (tensor or context parallel) is a graph break: the code on both sides
of it is still compiled. Compilation is lazy: the first forward of a step traces and compiles, later ones reuse.

The backend is inductor, the default. On a CPU it generates C++ and needs a C++ compiler; without one the run is
refused before it starts (one line), never silently run uncompiled or on another backend.
"""

from __future__ import annotations

import torch
from torch import nn


def check_can_compile(device: str) -> None:
    """A one-line ValueError unless inductor can compile for `device` ("auto", "cpu" or "cuda") here."""
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return  # inductor generates Triton kernels for CUDA (part of a CUDA torch)
    from torch._inductor import cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        raise ValueError("--compile on a CPU needs a C++ compiler (inductor generates C++), and none was found "
                          "(g++ on PATH, or $CXX); install one or leave out --compile") from None


def compile_blocks(model: nn.Module) -> nn.Module:
    """Compile every block of `model.blocks` in place (names, parameters and later module swaps unchanged)."""
    for block in model.blocks:
        block.compile()
    return model


def compiled_blocks(model: nn.Module) -> int:
    """How many of `model.blocks` go through compiled code (a pipeline stage's missing blocks are None)."""
    return sum(getattr(block, "_compiled_call_impl", None) is not None for block in model.blocks if block is not None)
