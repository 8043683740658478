"""Transformations of the model's blocks, applied in place before a run: activation recomputation and `--compile`.

Both wrap each block rather than replace it, so parameter names, the layout transformations that swap sub-modules
(tensor, expert parallel) and pipeline stages that call blocks all keep working.

* `apply_recompute`: activation checkpointing of every block (Chen et al. 2016, "Training Deep Nets with Sublinear
  Memory Cost"): the forward keeps only each block's input, the backward runs the block again to rebuild what it
  needs. Activation memory falls from every block's saved tensors to one [B, T, d] input per block, for one more
  forward per step (Korthikanti et al. 2022, §4: "full recomputation"). `mode="selective"` checkpoints each block
  with a per-operator policy instead (`keep_matmuls`): the outputs of the matrix products and of the fused attention
  kernel are kept, every other operator (the norms, RoPE, SiLU and the gate's product, the residual adds, the
  copies and the collectives between them) runs again in the backward. Why this one, and not Korthikanti et al.'s
  selective recomputation (their §5: recompute the softmax and dropout of attention): with fused SDPA and no
  dropout there is no s × s tensor to drop, so theirs saves nothing here. What this block saves beyond its matmul
  outputs is the element-wise work: each RMSNorm's fp32 input, its normalized tensor and its output, RoPE's rotated
  q and k, SDPA's contiguous output, SwiGLU's SiLU output and product; cheap to recompute (no matmul FLOPs), a
  little over half the block's saved bytes (`plan.rank_memory.layer_activation_bytes`). torchtitan's op-level
  selective activation checkpointing uses the same mechanism (`create_selective_checkpoint_contexts`).
* `compile_blocks`: `torch.compile` of every transformer block. Each block is compiled in place (`nn.Module.compile`:
  the module, its name and its parameters stay; its call goes through the compiled code), not the whole model: the
  blocks are where the time goes, they are identical in structure so one graph serves them all, and the layout
  transformations keep blocks whole. A collective inside a block (tensor or context parallel) is a graph break: the
  code on both sides of it is still compiled. Compilation is lazy: the first forward of a step traces and compiles,
  later ones reuse.

* `use_attention_kernel`: `--attention-kernel triton` swaps every block's attention core (SDPA, `CausalAttention`)
  for chapter 19's Triton FlashAttention-2 (`minidist.kernels.core.TritonAttention`), as context parallelism swaps
  in its cores: the model's code stays plain PyTorch, parameter names and checkpoints unchanged.

The backend is inductor by default (`--compile-backend`). On a CPU it generates C++ and needs a C++ compiler; without
one the run is refused before it starts (one line, `check_can_compile`), never silently run uncompiled or on another
backend. `aot_eager` runs the layers inductor sits on (dynamo's graphs, AOTAutograd's joint forward and backward,
functionalization, donated buffers) and then the same aten kernels eagerly: no code generation, no C++ compiler, and
the eager run's numbers; it is how a CPU rehearses CUDA's compiled path. `eager` stops after dynamo.
`frames_compiled()`: dynamo's count of the frames it compiled, a first compile or a recompile (metrics.jsonl's
`compiles`: those of each step).
`resolve_compile`: without --compile or --no-compile, a run compiles on CUDA (Triton installed) and not on a CPU.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from minidist.model.fp8_gemm import fp8_gemm
from minidist.model.moe.layer import Replaying
from minidist.model.moe.stats import moe_layers

RECOMPUTE_MODES = ("full", "selective")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")

# The operators whose outputs selective recomputation keeps: the matrix products (a linear on a [B, T, d] input is
# an `mm` below autograd; grouped experts use `bmm`; an FP8 linear's GEMM is one `minidist::fp8_gemm`, whose output
# is in the layer's dtype: the fp32 partials inside it are never kept) and the fused attention kernels (their output
# and log-sum-exp).
_KEPT_OPS = tuple(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name)) + (fp8_gemm._opoverload,)


def keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The selective policy: keep what costs FLOPs to recompute (matmuls, attention), recompute the rest."""
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _Both(contextlib.ExitStack):
    """Two context managers entered together (a selective replay of an MoE block: the policy's and `Replaying`)."""

    def __init__(self, *contexts: contextlib.AbstractContextManager) -> None:
        super().__init__()
        self._contexts = contexts

    def __enter__(self) -> _Both:
        super().__enter__()
        for context in self._contexts:
            self.enter_context(context)
        return self


def _recompute_contexts(block: nn.Module, selective: bool) -> tuple[contextlib.AbstractContextManager, ...]:
    """(the first forward's context, the replay's): the replay routes MoE tokens again but counts nothing; under
    selective recomputation both also carry the policy's caches."""
    if not selective:
        return contextlib.nullcontext(), Replaying(block)
    forward, replay = create_selective_checkpoint_contexts(keep_matmuls)
    return (forward, _Both(replay, Replaying(block))) if moe_layers(block) else (forward, replay)


def _recomputed_forward(forward, *args, **kwargs):
    # use_reentrant=False: the supported implementation; keeps the RNG state and works with keyword arguments.
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_recompute(model: nn.Module, mode: str = "full") -> nn.Module:
    """Recompute every block of `model.blocks` in the backward (in place: the block's own forward is wrapped):
    all of it (`mode="full"`) or all but its matmuls and attention (`"selective"`, the `keep_matmuls` policy).

    A block with MoE layers replays its forward under `Replaying` (each routing counted once). Under full
    recomputation only those take a context_fn: inductor accepts none but selective-checkpoint ones in a traced
    region, and an MoE layer's Python attributes (`aux_loss`, `last_stats`) make dynamo run its block's checkpoint
    eagerly anyway."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute mode must be one of {RECOMPUTE_MODES}, got {mode!r}")
    selective = mode == "selective"
    for block in model.blocks:
        contexts = {"context_fn": functools.partial(_recompute_contexts, block, selective)} \
            if selective or moe_layers(block) else {}
        block.forward = functools.partial(_recomputed_forward, block.forward, **contexts)
    return model


def check_can_compile(device: str, backend: str = "inductor") -> None:
    """A one-line ValueError unless `backend` can compile for `device` ("auto", "cpu" or "cuda") here: only
    inductor on a CPU generates code (C++), the other backends need no compiler."""
    if backend != "inductor" or device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return  # inductor generates Triton kernels for CUDA (part of a CUDA torch)
    from torch._inductor import cpp_builder, exc

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler:
        raise ValueError("--compile on a CPU needs a C++ compiler (inductor generates C++), and none was found "
                          "(g++ on PATH, or $CXX); install one or leave out --compile") from None


def resolve_compile(setting: bool | None, device: torch.device) -> bool:
    """--compile / --no-compile as given; by default (None) on CUDA where Triton (inductor's GPU code) is installed,
    off on a CPU: there inductor needs a C++ compiler and a first step of ~25 s of compilation, which tests and
    notebooks do not want, and the fusion it buys is a GPU's (fp32 element-wise work is memory-bound there)."""
    if setting is not None:
        return setting
    return device.type == "cuda" and importlib.util.find_spec("triton") is not None


def compile_blocks(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """Compile the forward of every block of `model.blocks` in place (names, parameters and later module swaps
    unchanged). The forward, not the module's call (`nn.Module.compile`): the hooks on a block (ZeRO-3 gathers
    its parameters in one, `param.data = gathered`) stay outside the graph; traced, AOTAutograd made them
    mutations of the parameters, whose version counters then failed the saved parameters' check in the backward."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"compile backend {backend!r} is unknown; choose one of {COMPILE_BACKENDS}")
    for block in model.blocks:
        block.forward = torch.compile(block.forward, backend=backend)
    return model


def keep_gemms_eager(model: nn.Module) -> None:
    """Run every module that owns a weight matrix (linears of any kind, experts) outside the compiled graphs: a
    graph break around each. A compiled graph is one autograd node that computes all its gradients at once; a
    matmul left to autograd computes dX and dW apart, which is what a zero-bubble schedule's B and W split
    (`parallel.pp.split_backward`). Called after `parallelize`, whose swaps (tensor, expert parallel) are kept."""
    for module in model.modules():
        if any(p.dim() >= 2 for p in module.parameters(recurse=False)) and "forward" not in module.__dict__:
            module.forward = torch.compiler.disable(module.forward)


def frames_compiled() -> int:
    """The frames dynamo has compiled so far in this process (its counter of cache misses: a first compile, or a
    recompile after a guard failed on a new shape or a changed Python value); a run in steady state adds none."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def use_attention_kernel(model: nn.Module, kernel: str) -> int:
    """Swap every SDPA attention core of `model` for the Triton kernel's when `kernel` is "triton" (in place); the
    number of cores swapped. Triton is imported only then (a run with "sdpa" needs none installed)."""
    if kernel == "sdpa":
        return 0
    if kernel != "triton":
        raise ValueError(f"unknown attention kernel {kernel!r}; choose sdpa or triton")
    from minidist.kernels.core import TritonAttention
    from minidist.model.attention import CausalAttention

    cores = [m for m in model.modules() if isinstance(getattr(m, "core", None), CausalAttention)]
    for module in cores:
        module.core = TritonAttention()
    return len(cores)
