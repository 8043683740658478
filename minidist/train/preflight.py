"""Everything the trainer checks before any process group exists: the settings, the layout against the world size,
the model against the layout, OUT, the fault drill and the device.

Bad input fails here, in one line, before any rank waits for another: a layout that does not divide the world
size, a batch that does not split over the replicas, a model that cannot be cut over tp ranks or pp stages. The
checks of the lower layers raise ValueError; this module words every one of them as a ConfigError.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from minidist import flops, kernels, memory
from minidist.comm.bootstrap import DistEnv, pick_device
from minidist.comm.topology import ParallelDims
from minidist.comm.torch_support import check_torch
from minidist.data.training_data import TrainingData, load_training_data
from minidist.model import ModelConfig
from minidist.model.fp8_gemm import native_blockwise
from minidist.parallel.cp import validate_context_parallel
from minidist.parallel.ep.expert import validate_expert_parallel
from minidist.parallel.layout import Layout, ParallelOptions
from minidist.parallel.pp.pipeline import validate_pipeline
from minidist.parallel.tp.tensor import validate_fp8_blocks, validate_tensor_parallel
from minidist.precision import resolve_dtype
from minidist.train import kernel_contracts, run_dir
from minidist.train.config import ConfigError, TrainConfig, check_config, model_config
from minidist.trust import faults


@dataclass(frozen=True)
class Preflight:
    """What the checks established: this process's place in the job, the layout and the device."""

    env: DistEnv
    layout: Layout
    device: torch.device


def preflight(cfg: TrainConfig) -> Preflight:
    """Every check that needs no process group, in the order a user fixes them; one ConfigError for the first."""
    check_config(cfg)
    try:
        check_torch()  # a node's own torch may be older than what the package calls
        env = DistEnv.detect()  # torchrun's or srun's variables: a place that does not fit, srun without MASTER_ADDR
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_fits(cfg, env.world_size)  # before anything loops over layers or allocates
    layout = resolve_layout(cfg, env.world_size, env)
    check_kernel_contracts(cfg, layout.dims)  # a CUDA run's GEMMs against CUDA's rules: no GPU needed
    run_dir.check_out(cfg)  # an OUT we cannot write, or one holding a run this one would destroy
    try:
        faults.check_fault(cfg.inject_fault, cfg.steps, env.world_size)
        device = pick_device(cfg.device, env)
        if device.type == "cuda" and cfg.fp8 != "none":
            kernel_contracts.check_fp8_device(torch.cuda.get_device_name(device),
                                              torch.cuda.get_device_capability(device), cfg.peak_flops)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_attention_kernel(cfg.attention_kernel, device)
    return Preflight(env, layout, device)


def check_kernel_contracts(cfg: TrainConfig, dims: ParallelDims) -> None:
    """A run on CUDA (--device cuda, or auto with a GPU): its FP8 GEMMs (a rank's tokens per micro-batch after cp,
    its tp shards) and its experts' grouped GEMMs run on fake CUDA tensors (`train/kernel_contracts.py`, in a
    subprocess); the first rule one breaks is a one-line ConfigError."""
    if not (cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())):
        return
    mcfg = model_config(cfg)
    native = torch.cuda.is_available() and native_blockwise(torch.device("cuda", 0))
    tokens = cfg.batch_size // (dims.dp * cfg.microbatches) * cfg.seq_len // dims.cp
    dtype = resolve_dtype(cfg.dtype, torch.device("cuda"))
    spec = kernel_contracts.contract_spec(mcfg, dims, cfg.fp8, cfg.fp8_block, tokens, dtype, native)
    if not spec["fp8"] and not spec["experts"]:
        return
    try:
        failures = kernel_contracts.run_fake_cuda_check(spec)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if failures:
        more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
        raise ConfigError(failures[0] + more)


def check_attention_kernel(kernel: str, device: torch.device) -> None:
    """--attention-kernel triton: Triton installed, and on a CPU its interpreter chosen before the start."""
    why = kernels.unavailable(device.type) if kernel == "triton" else None
    if why:
        raise ConfigError(why)


def check_fits(cfg: TrainConfig, world_size: int) -> None:
    """One-line ConfigError when a run cannot fit in this machine's memory (a GPU's, else the host's RAM) whatever
    the layout: lower bounds from chapter 01's formulas (minidist.memory), so a run that fits is never refused.
    Per rank: the fp32 weights, gradients and two AdamW moments (16 bytes per parameter) split evenly over every
    rank; one block's saved activations (fp32) for one rank's share of a micro-batch; the validation batches
    (int64 inputs and targets, held whole by every rank)."""
    mcfg = model_config(cfg)
    params = param_count(mcfg)
    rows = max(1, cfg.batch_size // (world_size * cfg.microbatches))
    needs = {"model states": memory.model_state_bytes(params, 4, 4, 0, 8)["total"] / world_size,
             "one block's activations": memory.activation_bytes_per_layer(
                 mcfg, -(-cfg.seq_len // world_size), rows, 4)["total"] / world_size,
             "validation batches": cfg.eval_batches * cfg.batch_size * cfg.seq_len * 16}
    where, have = memory_capacity(cfg.device)
    if sum(needs.values()) > have:
        big = max(needs, key=needs.get)
        raise ConfigError(f"this run needs at least {sum(needs.values()) / 2**30:,.1f} GiB per rank ({big}: "
                          f"{needs[big] / 2**30:,.1f} GiB; {params:,} parameters) but {where} has "
                          f"{have / 2**30:,.1f} GiB; use a smaller model, batch or --eval-batches, or more ranks")


def param_count(mcfg: ModelConfig) -> int:
    """flops.count_params without a Python loop over 10^7 layers: layers past the first MoE one are alike."""
    first = min(mcfg.n_layers, mcfg.moe.first_dense_layers + 1)
    base = flops.count_params(dataclasses.replace(mcfg, n_layers=first))
    if mcfg.n_layers == first:
        return base
    per_layer = flops.count_params(dataclasses.replace(mcfg, n_layers=first + 1)) - base
    return base + (mcfg.n_layers - first) * per_layer


def memory_capacity(device: str) -> tuple[str, int]:
    """(what, bytes) of the memory a rank's tensors live in: the first GPU's when the run will use one, else RAM."""
    if device in ("auto", "cuda") and torch.cuda.is_available():
        return "the GPU", torch.cuda.get_device_properties(0).total_memory
    return "this machine's RAM", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def launch_hint(cfg: TrainConfig, env: DistEnv) -> str:
    """How to start as many processes as the layout's degrees ask for, when that is not the world size."""
    wanted = (cfg.dp or 1) * cfg.tp * cfg.pp * cfg.cp
    if wanted == env.world_size:
        return ""
    if env.launcher == "single":
        return (f"; this is one process: launch the {wanted} this layout needs with "
                f"torchrun --nproc_per_node={wanted} -m minidist.train ...")
    if env.launcher == "torchrun" and env.local_world_size == env.world_size:  # one node
        return f"; this layout needs {wanted} processes: torchrun --nproc_per_node={wanted}"
    return f"; this layout needs {wanted} processes, the launcher started {env.world_size}"


def resolve_layout(cfg: TrainConfig, world_size: int, env: DistEnv | None = None) -> Layout:
    """The layout of this run (the grid's degrees, how each dimension is applied, the recomputation), checked
    against the world size and the model."""
    rest = cfg.tp * cfg.pp * cfg.cp
    dp = cfg.dp if cfg.dp is not None else max(1, world_size // rest)
    options = ParallelOptions(sequence_parallel=cfg.sp, tp_reduce_fp32=cfg.tp_reduce_fp32, schedule=cfg.schedule,
                              microbatches=cfg.microbatches, virtual_stages=cfg.virtual_stages, zero=cfg.zero,
                              cp_impl=cfg.cp_impl, loss_chunk=cfg.loss_chunk,
                              bucket_bytes=None if cfg.bucket_mb is None else round(cfg.bucket_mb * 2**20))
    try:
        layout = Layout(ParallelDims(dp=dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep), options, cfg.recompute)
        layout.dims.validate(world_size)
    except ValueError as e:  # with how many processes to start, when the launcher's place is known
        raise ConfigError(f"{e}{launch_hint(cfg, env) if env is not None else ''}") from None
    dims = layout.dims
    if cfg.batch_size % (dims.dp * cfg.microbatches):
        raise ConfigError(f"batch_size {cfg.batch_size} is not divisible by dp*microbatches = "
                          f"{dims.dp}*{cfg.microbatches}; pick a multiple of {dims.dp * cfg.microbatches}")
    check_model_split(cfg, dims)
    return layout


def check_model_split(cfg: TrainConfig, dims: ParallelDims) -> None:
    """Chapters 08-11: can the model be cut over tp ranks, pp stages, cp ranks and ep ranks this way?"""
    mcfg = model_config(cfg)
    if cfg.sp and dims.tp == 1:
        raise ConfigError("--sp (sequence parallel) splits the sequence over tensor-parallel ranks: it needs --tp > 1")
    if dims.pp == 1 and cfg.virtual_stages > 1:
        raise ConfigError(f"--virtual-stages {cfg.virtual_stages} cuts each pipeline rank's layers into chunks: "
                          "it needs --pp > 1")
    try:
        validate_tensor_parallel(mcfg, dims.tp, cfg.seq_len, cfg.sp)
        validate_fp8_blocks(mcfg, dims.tp, cfg.fp8, cfg.fp8_block)
        validate_context_parallel(mcfg, dims.cp, cfg.cp_impl, cfg.seq_len, dims.tp, cfg.sp)
        validate_expert_parallel(mcfg, dims.ep, dims.dp * dims.cp)
        if dims.pp > 1:
            validate_pipeline(mcfg, dims.pp, cfg.microbatches, cfg.virtual_stages, cfg.schedule,
                              batch_size=cfg.batch_size // dims.dp)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def load_data(cfg: TrainConfig) -> TrainingData:
    """--data: a text source read into memory, or a prepared dataset read row by row (minidist.data.training_data)."""
    try:
        corpus = load_training_data(cfg.data, cfg.val_fraction, cfg.max_bytes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    model_vocab = model_config(cfg).vocab_size
    if corpus.vocab_size > model_vocab:  # config_checks sets it from the manifest: a changed file
        raise ConfigError(f"the data's vocabulary is {corpus.vocab_size:,} but the model's is "
                          f"{model_vocab:,}; prepare the data again or set model.vocab_size")
    if corpus.train.numel() < cfg.seq_len + 1:
        raise ConfigError(f"the training split has {corpus.train.numel():,} tokens, fewer than seq_len + 1 = "
                          f"{cfg.seq_len + 1}; use more data or a shorter --seq-len")
    return corpus
