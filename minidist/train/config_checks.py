"""The trainer's settings checked before anything starts: `check_config` raises a one-line `ConfigError` for the
first bad setting (a range, a choice, a combination, the data path) and returns the resolved model config.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any

from minidist.comm.bootstrap import DEVICES
from minidist.data import training_data
from minidist.data.corpus import VOCAB_SIZE
from minidist.data.dataset import is_prepared
from minidist.kernels import ATTENTION_KERNELS
from minidist.model import ModelConfig, get_preset
from minidist.model.fp8_linear import RECIPES as FP8_RECIPES
from minidist.model.moe.dispatch import EXPERT_BACKENDS
from minidist.parallel.cp import IMPLS as CP_IMPLS
from minidist.parallel.layout import RECOMPUTE
from minidist.parallel.pp.schedules import ALL_SCHEDULES, ZB_SCHEDULES
from minidist.precision import DTYPES
from minidist.train.blocks import COMPILE_BACKENDS, check_can_compile
from minidist.train.dashboard import require_tensorboard
from minidist.train.optim import WarmupCosine
from minidist.train.profiling import parse_profile_steps
from minidist.train.settings import ConfigError, TrainConfig, config_to_values
from minidist.trust.faults import parse_fault


def coerce_setting(key: str, value: Any, hint: Any) -> Any:
    allowed = typing.get_args(hint) or (hint,)
    if value is None and type(None) in allowed:
        return None
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (bool in allowed) or not isinstance(value, allowed):
        names = " or ".join(t.__name__ for t in allowed if t is not type(None))
        raise ConfigError(f"{key} must be {names}, got {value!r}")
    return value


def model_config(cfg: TrainConfig) -> ModelConfig:
    """The preset with the overrides; a prepared dataset's vocabulary replaces the preset's (one that differs,
    given explicitly, is refused)."""
    overrides = _typed_fields(ModelConfig, cfg.model_overrides, "model")
    data_vocab = data_vocab_size(cfg)
    if data_vocab is not None:
        if overrides.get("vocab_size", data_vocab) != data_vocab:
            raise ConfigError(f"model.vocab_size {overrides['vocab_size']:,} differs from the {data_vocab:,} tokens "
                              f"of the tokenizer of {cfg.data}; leave model.vocab_size out (it follows the data)")
        overrides["vocab_size"] = data_vocab
    try:
        return get_preset(cfg.model, **overrides)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def data_vocab_size(cfg: TrainConfig) -> int | None:
    """A prepared dataset's vocabulary (its manifest read, no shard opened); None for a text source."""
    try:
        return training_data.data_vocab_size(cfg.data)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _typed_fields(cls: type, values: Any, where: str) -> dict[str, Any]:
    """`values` checked against the field types of dataclass `cls`: n_layers=2.0 is not an int, moe=3 is not a
    table. Sub-configs (tables) are checked field by field; unknown names are left for the model to report."""
    if not isinstance(values, dict):
        raise ConfigError(f"{where} must be a table (e.g. {where}={{...}}), got {values!r}")
    hints = typing.get_type_hints(cls)
    typed = {}
    for key, value in values.items():
        hint, name = hints.get(key), f"{where}.{key}"
        if hint is None:
            typed[key] = value
        elif dataclasses.is_dataclass(hint):  # a table, or already the sub-config itself
            typed[key] = value if isinstance(value, hint) else _typed_fields(hint, value, name)
        else:
            typed[key] = coerce_setting(name, value, hint)
    return typed


def _non_finite(values: Any, where: str = "") -> list[str]:
    """Names of the float settings in `values` (nested dicts) that are NaN or infinite."""
    if isinstance(values, dict):
        return [bad for k, v in values.items() for bad in _non_finite(v, f"{where}.{k}" if where else k)]
    return [f"{where}={values}"] if isinstance(values, float) and not math.isfinite(values) else []


def check_config(cfg: TrainConfig) -> ModelConfig:
    """Raise a one-line ConfigError for the first bad setting; return the resolved model config."""
    non_finite = _non_finite(config_to_values(cfg))
    if non_finite:
        raise ConfigError(f"settings must be finite numbers, got {', '.join(non_finite)}")
    mcfg = model_config(cfg)
    if is_prepared(cfg.data):  # recorded in the run's settings: a checkpoint rebuilds the model without it
        cfg.model_overrides = {**cfg.model_overrides, "vocab_size": mcfg.vocab_size}
    _check_ranges(cfg)
    _check_batch_and_model(cfg, mcfg)
    _check_choices(cfg)
    _check_combinations(cfg)
    _check_data(cfg)
    try:
        if cfg.compile:  # asked for; the default (None) compiles only where it can (blocks.resolve_compile)
            check_can_compile(cfg.device, cfg.compile_backend)
        if cfg.inject_fault is not None:
            parse_fault(cfg.inject_fault)  # the spec's form; its step and rank are checked against the run later
        if cfg.tensorboard:
            require_tensorboard()  # an optional extra: refused here, never a run that silently writes none
        if cfg.profile_steps is not None:
            parse_profile_steps(cfg.profile_steps, cfg.steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    lr_schedule(cfg)  # its own checks (lr >= min_lr >= 0)
    return mcfg


# The lowest value of each integer setting.
AT_LEAST = {"steps": 1, "batch_size": 1, "seq_len": 1, "microbatches": 1, "eval_batches": 1, "log_every": 1,
            "eval_every": 0, "ckpt_every": 0, "warmup_steps": 0, "zero": 0, "tp": 1, "pp": 1, "cp": 1, "ep": 1,
            "virtual_stages": 1, "keep": 1, "check_every": 0, "loss_chunk": 0, "fp8_block": 1}


# 1 s: below it gloo's own connect times out before the peers meet ("Connect timeout", naming no flag)
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 7 * 24 * 3600.0


def _check_ranges(cfg: TrainConfig) -> None:
    for key, low in AT_LEAST.items():
        if getattr(cfg, key) < low:
            raise ConfigError(f"{key} must be >= {low}, got {getattr(cfg, key)}")
    if not 0 <= cfg.stop_after <= cfg.steps:
        raise ConfigError(f"--stop-after {cfg.stop_after} is outside 0..steps ({cfg.steps}): N completed steps of "
                          "--steps, then a checkpoint and exit (0: run all steps)")
    if cfg.dp is not None and cfg.dp < 1:
        raise ConfigError(f"dp must be >= 1, got {cfg.dp}")
    if cfg.zero > 3:
        raise ConfigError(f"zero must be 0, 1, 2 or 3, got {cfg.zero}")
    for key in ("weight_decay", "grad_clip"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"{key} must be >= 0, got {getattr(cfg, key)}")
    if not 0 <= cfg.val_fraction < 1:
        raise ConfigError(f"val_fraction must be in [0, 1), got {cfg.val_fraction}")
    if cfg.max_bytes is not None and cfg.max_bytes < 1:
        raise ConfigError(f"max_bytes must be >= 1, got {cfg.max_bytes}")
    if cfg.bucket_mb is not None and not cfg.bucket_mb * 2**20 >= 1:
        raise ConfigError(f"bucket_mb must be > 0 (at least one byte), got {cfg.bucket_mb}")
    for key in ("comm_timeout", "ckpt_timeout"):
        if getattr(cfg, key) <= 0:
            raise ConfigError(f"{key} must be > 0 seconds, got {getattr(cfg, key)}")
        if not MIN_TIMEOUT_S <= getattr(cfg, key) <= MAX_TIMEOUT_S:  # the backend counts whole ms in a C++ int
            raise ConfigError(f"--{key.replace('_', '-')} must be between {MIN_TIMEOUT_S:g} and {MAX_TIMEOUT_S:g} "
                              f"seconds (one week), got {getattr(cfg, key)}")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(cfg, key) < 1:
            raise ConfigError(f"{key} must be in [0, 1), got {getattr(cfg, key)}")
    if cfg.peak_flops is not None and not cfg.peak_flops > 0:
        raise ConfigError(f"peak_flops must be > 0 FLOP/s, got {cfg.peak_flops} (leave it out to use the chip's)")
    if not 0 <= cfg.seed < 2**63:
        raise ConfigError(f"seed must be in [0, 2**63), got {cfg.seed}")


def _check_batch_and_model(cfg: TrainConfig, mcfg: ModelConfig) -> None:
    if cfg.batch_size % cfg.microbatches:
        fits = [m for m in range(1, cfg.batch_size + 1) if cfg.batch_size % m == 0]
        raise ConfigError(f"batch_size {cfg.batch_size} is not divisible by microbatches {cfg.microbatches}; "
                          f"microbatches in {fits} would fit")
    if cfg.seq_len > mcfg.max_seq_len:
        raise ConfigError(f"seq_len {cfg.seq_len} exceeds the model's max_seq_len {mcfg.max_seq_len}; "
                          f"lower --seq-len or --set model.max_seq_len={cfg.seq_len}")
    if mcfg.vocab_size < VOCAB_SIZE and not is_prepared(cfg.data):  # a dataset's is the model's (model_config)
        raise ConfigError(f"model vocab_size {mcfg.vocab_size} is below the {VOCAB_SIZE} byte tokens of the data")


def _check_choices(cfg: TrainConfig) -> None:
    """Each named choice against the list its owner keeps (precision, schedules, context parallel, devices)."""
    for key, allowed in (("dtype", DTYPES), ("fp8", ("none", *FP8_RECIPES)), ("recompute", RECOMPUTE),
                         ("device", DEVICES), ("schedule", ALL_SCHEDULES), ("cp_impl", CP_IMPLS),
                         ("compile_backend", COMPILE_BACKENDS), ("expert_backend", EXPERT_BACKENDS),
                         ("attention_kernel", ATTENTION_KERNELS)):
        if getattr(cfg, key) not in allowed:
            raise ConfigError(f"{key} {getattr(cfg, key)!r} is unknown; choose one of {allowed}")


def _check_combinations(cfg: TrainConfig) -> None:
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume continues the run in OUT and --overwrite replaces it; give one of them")
    if cfg.loss_chunk and cfg.tp > 1:
        raise ConfigError("--loss-chunk with --tp > 1: the vocab-parallel loss is not chunked; use --loss-chunk 0")
    if cfg.loss_chunk and cfg.zero == 3:
        raise ConfigError("--loss-chunk with --zero 3: ZeRO-3 gathers the head's weight only inside the model's "
                          "forward, and the chunked loss runs after it; use --loss-chunk 0 or --zero 2")
    if cfg.attention_kernel == "triton" and cfg.cp > 1:
        raise ConfigError("--attention-kernel triton with --cp > 1: context parallelism runs its own block kernels "
                          "(ring, all-gather, Ulysses); use --cp 1 or --attention-kernel sdpa")
    if cfg.recompute == "selective" and cfg.cp > 1:
        raise ConfigError("--recompute selective with --cp > 1: the ring's attention runs one kernel per block of "
                          "keys, and the policy would keep every block's output; use --recompute full or --cp 1")
    if cfg.recompute == "selective" and cfg.pp > 1 and cfg.schedule in ZB_SCHEDULES:
        raise ConfigError(f"--recompute selective with --schedule {cfg.schedule}: W reads the block's recomputed "
                          "tensors again after B, and selective checkpointing lets each be read once; use "
                          "--recompute full or a schedule without a B/W split (1f1b, interleaved)")
    bf16 = cfg.dtype == "bf16" or (cfg.dtype == "auto" and cfg.device == "cuda")
    if cfg.compile and cfg.expert_backend == "grouped_mm" and not bf16:
        raise ConfigError("--expert-backend grouped_mm with --compile needs --dtype bf16: torch.compile traces "
                          "torch._grouped_mm with CUDA's rule (bf16 operands) on any device; use --dtype bf16 or "
                          "--expert-backend auto")


def _check_data(cfg: TrainConfig) -> None:
    path = Path(cfg.data).expanduser()
    if cfg.data != "stdlib" and not any(c in cfg.data for c in "*?[") and not path.exists():
        raise ConfigError(f"data path {cfg.data!r} does not exist; give a text file, a directory, a glob, "
                          "a .bin/.npy file, 'stdlib', or a dataset directory (python -m minidist.data prepare)")
    try:
        training_data.check_max_bytes(cfg.data, cfg.max_bytes)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.data != "stdlib" and path.exists() and not (path.is_file() or path.is_dir()):  # would never finish reading
        raise ConfigError(f"data path {cfg.data!r} is not a regular file or a directory (a FIFO or a device?)")


def lr_schedule(cfg: TrainConfig) -> WarmupCosine:
    try:
        return WarmupCosine(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
