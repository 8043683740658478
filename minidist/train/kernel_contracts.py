"""CUDA's kernel contracts, checked before any process group starts (`train/preflight.py`), each broken one named in
one line: what a GPU run would otherwise learn from a crash in its first step, on every rank.

- FP8 needs FP8 tensor cores, compute capability >= 8.9 (Ada, Hopper, Blackwell), and MFU needs the chip's FP8
  datasheet peak (`minidist/hardware.py`) or --peak-flops (`check_fp8_device`).
- Every FP8 GEMM (`torch._scaled_mm`): A row-major, B column-major, the contraction and output dimensions multiples
  of 16. That is each FP8 linear's in and out features on this rank's tp shard (MLA's `wkv_a` has kv_lora_rank +
  qk_rope_head_dim outputs: 32 + 8 = 40 by default), and for the weight gradient, which contracts over the tokens,
  a rank's tokens per micro-batch (batch / (dp · microbatches) · seq_len / cp); blockwise's K-slices
  (--fp8-block) and the scale layouts of torch's native block-scaled GEMM too.
- `torch._grouped_mm` (the MoE experts' "auto" backend on CUDA): bf16 operands, rows 16-byte aligned.
- FlashAttention-2 (context parallelism's CUDA block kernel): head_dim a multiple of 8 and at most 256, written by
  hand in `parallel/cp/blockwise.py` (`block_kernel`), because torch's fake check accepts 12 and 264.

Where torch checks a rule itself, it checks it here: under `FakeTensorMode`, tensors made on "cuda" exist without a
GPU (shapes, strides and dtypes only), and CUDA's meta functions then apply CUDA's rules. `fake_cuda_failures` runs
the package's own three FP8 GEMM calls per linear (`fp8_linear.forward_gemm`, `input_grad_gemm`,
`weight_grad_gemm`: the same quantization, layouts and kernel choice as a step) and the experts' grouped GEMMs on
such tensors, with no_grad. It runs in a subprocess (`python -m minidist.train.kernel_contracts`, a JSON spec on
stdin): on a CPU-only torch, anything that records autograd on a fake CUDA tensor aborts the process.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

import minidist
from minidist import hardware
from minidist.comm.topology import ParallelDims
from minidist.model import ModelConfig
from minidist.model.fp8_linear import Fp8Recipe, convert_to_fp8, forward_gemm, input_grad_gemm, weight_grad_gemm
from minidist.model.moe.dispatch import grouped_mm_choice
from minidist.parallel.materialize import meta_model
from minidist.parallel.tp.tensor import tensor_parallel_plan

FP8_CAPABILITY = (8, 9)
GEMMS = ("forward", "input gradient", "weight gradient")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def check_fp8_device(device_name: str, capability: tuple[int, int], peak_override: float | None) -> None:
    """One-line ValueError when `--fp8` cannot run, or its MFU cannot be measured, on this GPU."""
    if tuple(capability) < FP8_CAPABILITY:
        raise ValueError(f"--fp8 needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper, Blackwell); "
                         f"{device_name} is {capability[0]}.{capability[1]}; use --fp8 none")
    chip = hardware.datasheet_chip(device_name)
    if chip is not None and "fp8" not in hardware.chip(chip).dense_peak and not peak_override:
        raise ValueError(f"--fp8 on {device_name}: minidist/hardware.py has no FP8 datasheet peak for {chip} to "
                         "measure MFU against; pass --peak-flops (its dense FP8 FLOP/s)")


def fp8_linear_shapes(mcfg: ModelConfig, tp: int) -> dict[str, tuple[int, int]]:
    """{name, block index as *: (out, in) features on one tp rank} of every FP8 linear of the model's blocks."""
    first = min(mcfg.n_layers, mcfg.moe.first_dense_layers + 1)
    model = meta_model(dataclasses.replace(mcfg, n_layers=first))  # the later blocks repeat these
    names = convert_to_fp8(model, Fp8Recipe("tensorwise"))
    plan = tensor_parallel_plan(model) if tp > 1 else {}
    kv_split = mcfg.n_kv_heads % tp == 0
    shapes = {}
    for name in names:
        n, k = model.get_submodule(name).weight.shape
        style = plan.get(name)
        if style == "colwise" or (style == "colwise_kv" and kv_split):
            n //= tp
        elif style == "colwise_kv":  # tp > n_kv_heads: one replicated kv head per rank
            n = mcfg.head_dim
        elif style == "rowwise":
            k //= tp
        parts = name.split(".")
        shapes[".".join(parts[:1] + ["*"] + parts[2:])] = (n, k)
    return shapes


def contract_spec(mcfg: ModelConfig, dims: ParallelDims, fp8: str, fp8_block: int, tokens: int, dtype: str,
                  native_blockwise: bool) -> dict:
    """What `fake_cuda_failures` checks for one run: its FP8 linears' GEMMs (`tokens`: a rank's tokens per
    micro-batch) and its experts' grouped GEMMs, in the run's compute dtype ("fp32" or "bf16")."""
    spec: dict = {"dtype": dtype, "fp8": [], "experts": []}
    if fp8 != "none":
        spec["fp8"] = [{"name": name, "recipe": fp8, "block": fp8_block, "native": native_blockwise,
                        "m": tokens, "n": n, "k": k} for name, (n, k) in fp8_linear_shapes(mcfg, dims.tp).items()]
    if mcfg.moe.n_experts:
        spec["experts"] = [{"d_model": mcfg.d_model, "d_expert": mcfg.moe.d_expert or mcfg.d_ff, "tokens": tokens}]
    return spec


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _fp8_failures(p: dict, out_dtype: torch.dtype) -> list[str]:
    recipe = Fp8Recipe(p["recipe"], p["block"])
    m, n, k = p["m"], p["n"], p["k"]
    x, w = torch.empty(m, k, device="cuda"), torch.empty(n, k, device="cuda")
    grad = torch.empty(m, n, device="cuda", dtype=out_dtype)
    calls = {"forward": lambda: forward_gemm(x, w, recipe, None, out_dtype, p["native"]),
             "input gradient": lambda: input_grad_gemm(grad, w, recipe, None, torch.float32, p["native"]),
             "weight gradient": lambda: weight_grad_gemm(grad, x, recipe, None, torch.float32, p["native"])}
    failures = []
    for gemm, call in calls.items():
        try:
            call()
        except Exception as e:  # torch's own words for the rule this GEMM breaks
            failures.append(f"--fp8 {p['recipe']} on CUDA: {p['name']}'s {gemm} GEMM (tokens M={m}, out N={n}, "
                            f"in K={k} on this rank) breaks torch._scaled_mm's rule: {_first_line(e)}; FP8 GEMMs "
                            "need each linear's features on a tp rank and a rank's tokens per micro-batch "
                            "(batch/(dp*microbatches)*seq_len/cp) in multiples of 16")
    return failures


def _expert_failures(p: dict, dtype: torch.dtype) -> list[str]:
    """The experts' grouped GEMMs as `Experts.forward` calls them when the "auto" backend picks them (`force`: in
    that dtype whatever the rule says)."""
    d, f, s = p["d_model"], p["d_expert"], p["tokens"]
    autocast = dtype if dtype != torch.float32 else None
    run_dtype = _DTYPES[p["force"]] if "force" in p else grouped_mm_choice(torch.float32, torch.float32, "cuda",
                                                                           autocast, (d, f))
    if run_dtype is None:
        return []  # the per-expert loop: plain matmuls
    offs = torch.empty(4, dtype=torch.int32, device="cuda")
    x, h = torch.empty(s, d, dtype=run_dtype, device="cuda"), torch.empty(s, f, dtype=run_dtype, device="cuda")
    w_in, w_out = (torch.empty(4, *shape, dtype=run_dtype, device="cuda") for shape in ((d, f), (f, d)))
    try:
        torch._grouped_mm(x, w_in, offs=offs)
        torch._grouped_mm(h, w_out, offs=offs)
    except Exception as e:
        return [f"MoE experts on CUDA: torch._grouped_mm (d_model {d}, d_expert {f}, {run_dtype}) breaks its rule: "
                f"{_first_line(e)}; it needs bf16 operands whose rows are multiples of 16 bytes"]
    return []


def fake_cuda_failures(spec: dict) -> list[str]:
    """Every broken rule of `spec`'s kernels, one line each, found by running them on fake CUDA tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)  # it logs what it re-raises
    dtype = _DTYPES[spec["dtype"]]
    failures = []
    with FakeTensorMode(), torch.no_grad():
        for p in spec["fp8"]:
            failures += _fp8_failures(p, dtype)
        for p in spec["experts"]:
            failures += _expert_failures(p, dtype)
    return failures


def run_fake_cuda_check(spec: dict, timeout: float = 600) -> list[str]:
    """`fake_cuda_failures(spec)` in a subprocess of this Python, importing this copy of the package."""
    root = str(Path(minidist.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "minidist.train.kernel_contracts"], input=json.dumps(spec),
                          capture_output=True, text=True, timeout=timeout, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        why = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"the CUDA kernel-contract check crashed (exit {proc.returncode}): {why}")
    return json.loads(lines[-1])


if __name__ == "__main__":
    print(json.dumps(fake_cuda_failures(json.loads(sys.stdin.read()))))
