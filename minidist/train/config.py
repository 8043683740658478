"""The trainer's configuration: `TrainConfig`, read from defaults < a TOML file < command-line flags < `--set`
items (`parse_config`), checked by `check_config`. A bad value is a one-line `ConfigError`; the command line prints
it and exits with code 2. `minidist.train.loop` re-exports the public names.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import tomllib
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minidist.comm.bootstrap import DEVICES
from minidist.data.corpus import VOCAB_SIZE
from minidist.model import ModelConfig, get_preset
from minidist.model.config import ALL_PRESETS
from minidist.model.fp8_linear import RECIPES as FP8_RECIPES
from minidist.parallel.cp import IMPLS as CP_IMPLS
from minidist.parallel.layout import RECOMPUTE
from minidist.parallel.pp.schedules import ALL_SCHEDULES
from minidist.precision import DTYPES
from minidist.train.blocks import check_can_compile
from minidist.train.optim import WarmupCosine
from minidist.trust.faults import parse_fault

DESCRIPTION = ("The trainer: `python -m minidist.train` on one process, "
               "`torchrun --nproc_per_node=N -m minidist.train` on N.")


class ConfigError(ValueError):
    """A bad setting. The command line prints it as one line on stderr and exits with code 2."""


class RankConfigError(ConfigError):
    """A bad input one rank found after the process groups exist (its rank file, its fault drill): each rank
    prints its own, starting with its rank, where a ConfigError of the pre-flight (the same on all) is said once."""


@dataclass
class TrainConfig:
    """Every setting of a run. TOML keys and flags have the same names (flags with '-' for '_').

    The model is a preset plus overrides: `[model]` in TOML holds `preset = "tiny"` and any ModelConfig field
    (`n_layers = 2`, `moe = {n_experts = 4}`); on the command line `--model tiny --set model.n_layers=2`.
    """

    # model
    model: str = "tiny"
    model_overrides: dict = field(default_factory=dict)
    # data: "stdlib" (the standard library's source), a text file, a directory of text files, a .bin or .npy file
    data: str = "stdlib"
    max_bytes: int | None = None
    val_fraction: float = 0.05
    # batch: global sizes, whatever the layout
    batch_size: int = 16
    seq_len: int = 128
    microbatches: int = 1
    # optimizer and schedule
    steps: int = 200
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    # precision and device
    dtype: str = "auto"  # auto: bf16 on CUDA, fp32 on CPU (minidist.precision)
    fp8: str = "none"  # FP8 GEMMs of the blocks' linears: none, tensorwise, rowwise, blockwise (model/fp8_linear.py)
    fp8_block: int = 128  # the blockwise recipe's tile/block size (1 x B activations, B x B weights)
    recompute: str = "none"  # activation recomputation: none, selective (keep matmul outputs) or full (each block)
    loss_chunk: int = 0  # tokens per chunk of the head + cross-entropy (0: the whole micro-batch at once)
    compile: bool | None = None  # torch.compile each transformer block; None: on CUDA (with Triton), off elsewhere
    device: str = "auto"
    # parallel layout (dp None: whatever the other dimensions leave of the world size)
    dp: int | None = None
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_impl: str = "ring"  # context-parallel attention (with cp > 1): ring, allgather, ulysses
    ep: int = 1
    zero: int = 0
    bucket_mb: float | None = None  # gradient bucket cap in MiB (None: 25 on CUDA, 4 on a CPU)
    sp: bool = False  # sequence parallel (with tp > 1)
    tp_reduce_fp32: bool = False  # sum the tensor-parallel partial sums in fp32 (under bf16)
    schedule: str = "1f1b"  # pipeline schedule (with pp > 1)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedule)
    # evaluation, logging, checkpoints
    eval_every: int = 50
    eval_batches: int = 8
    log_every: int = 10
    ckpt_every: int = 100
    keep: int = 3  # checkpoints kept: the newest ones (and always the one `latest` names)
    resume: bool = False
    stop_after: int = 0  # end cleanly after N completed steps (checkpoint at N), the schedule of --steps
    overwrite: bool = False  # replace the run in OUT (its checkpoints, metrics, run.json, loss.png)
    out: str = "runs/tiny"
    seed: int = 0
    peak_flops: float | None = None
    plot: bool = True
    # trust nothing (minidist.trust.replicas, minidist.trust.faults)
    check_every: int = 50  # compare replicas every N steps, at every checkpoint, at resume and at the end
    comm_timeout: float = 300.0  # seconds a collective may wait for a peer before the job stops
    ckpt_timeout: float = 1800.0  # seconds the barriers around writing and reading checkpoints wait for a peer
    inject_fault: str | None = None  # a fault drill: bitflip:STEP:RANK[:NAME]


# (flag, help). The flag's key is the flag without dashes, '-' -> '_'; type and default come from TrainConfig.
FLAGS: list[tuple[str, str]] = [
    ("--model", f"model preset: {', '.join(sorted(ALL_PRESETS))}; override fields with --set model.KEY=V"),
    ("--data", "text source: 'stdlib', a text file, a directory, a glob, a .bin (uint8) or .npy file"),
    ("--max-bytes", "read at most this many bytes of the corpus (quick runs)"),
    ("--val-fraction", "fraction of the corpus held out for validation (split by file)"),
    ("--batch-size", "global batch in sequences, summed over data-parallel ranks and micro-batches"),
    ("--seq-len", "tokens per sequence"),
    ("--microbatches", "gradient accumulation: split each rank's batch into this many micro-batches"),
    ("--steps", "optimizer steps"),
    ("--lr", "peak learning rate, reached after the warm-up"),
    ("--min-lr", "learning rate at the end of the cosine decay"),
    ("--warmup-steps", "steps of linear warm-up"),
    ("--weight-decay", "AdamW decoupled weight decay on weight matrices (not norms, biases, embeddings)"),
    ("--beta1", "AdamW beta1"),
    ("--beta2", "AdamW beta2"),
    ("--grad-clip", "clip the global gradient norm to this value (0: no clipping; the norm is logged anyway)"),
    ("--dtype", "auto (bf16 on CUDA, fp32 on CPU), fp32, or bf16 autocast (weights, optimizer state and "
                "gradient reductions stay fp32)"),
    ("--fp8", "none, or the FP8 recipe of the blocks' linear layers (attention projections, MLPs, shared "
              "experts): tensorwise, rowwise, or blockwise (1xB/BxB, DeepSeek-V3); the embedding, head, norms, router "
              "and routed MoE experts stay in --dtype precision, weights and optimizer state in fp32"),
    ("--fp8-block", "B of --fp8 blockwise; with --tp > 1 every linear's shard must be whole blocks"),
    ("--recompute", "activation recomputation: none; selective (keep the blocks' matmul and attention outputs, "
                    "recompute norms, RoPE, SiLU, adds); full (keep each block's input, recompute the block)"),
    ("--loss-chunk", "compute the head and the cross-entropy over chunks of this many tokens, recomputed in the "
                     "backward, so the fp32 tokens x vocab logits never exist whole (0: off; not with --tp > 1 "
                     "or --zero 3)"),
    ("--device", "auto (cuda if available), cpu or cuda"),
    ("--bucket-mb", "gradient bucket cap in MiB: one all-reduce or reduce-scatter per bucket (default: 25 on CUDA, "
                    "DDP's; 4 on a CPU)"),
    ("--dp", "data-parallel degree (default: world size / (tp*pp*cp))"),
    ("--tp", "tensor-parallel degree"),
    ("--pp", "pipeline-parallel degree"),
    ("--cp", "context-parallel degree: each sequence split over cp ranks"),
    ("--cp-impl", "context-parallel attention with --cp > 1: ring (keys/values around the ring), allgather "
                  "(gather keys/values, Llama 3), ulysses (all-to-all between sequence and heads)"),
    ("--ep", "expert-parallel degree (carved out of dp*cp)"),
    ("--zero", "ZeRO stage: 0 (replicated), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters)"),
    ("--schedule", "pipeline schedule with --pp > 1: afab (all forwards, all backwards), 1f1b, interleaved; "
                   "zb1, zbv, dualpipev (zero bubble: backward split in B and W; the last two: 2 chunks/rank, a V)"),
    ("--virtual-stages", "model chunks per pipeline rank (the interleaved schedule; zbv and dualpipev imply 2)"),
    ("--eval-every", "validation loss every N steps and at the end (0: only at the end)"),
    ("--eval-batches", "validation micro-batches per evaluation (fixed, the same every time)"),
    ("--log-every", "progress line every N steps"),
    ("--ckpt-every", "checkpoint every N steps and at the end (0: never)"),
    ("--keep", "keep only the N newest checkpoints (never the one OUT/checkpoints/latest names)"),
    ("--stop-after", "end cleanly after N completed steps of --steps (its checkpoint is step N, the LR schedule "
                     "stays that of --steps), exit 0; continue with --resume, in any layout (0: run all --steps)"),
    ("--out", "output directory: metrics.jsonl, run.json, loss.png, checkpoints/"),
    ("--seed", "seed of the initialization and of the data order"),
    ("--peak-flops", "peak FLOP/s for MFU (default: datasheet for known GPUs, a measured matmul on CPU)"),
    ("--check-every", "compare the replicas' parameters and buffers (hashes) every N steps, at checkpoints, at "
                      "resume and at the end (0: only those)"),
    ("--comm-timeout", "seconds any collective waits for a peer before the job stops, naming the group"),
    ("--ckpt-timeout", "seconds the barriers around a checkpoint's files (each rank writes and hashes its own, "
                       "then waits for the others) wait for a peer: a slow filesystem, not a hung rank"),
    ("--inject-fault", "fault drill: bitflip:STEP:RANK[:NAME] flips one mantissa bit of one parameter on RANK "
                       "after step STEP"),
]


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line and exit code 2 (the minidist commands' parser)."""

    def error(self, message: str) -> typing.NoReturn:
        # One line, like every other configuration error (argparse would print the whole usage first).
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    defaults = TrainConfig()
    hints = typing.get_type_hints(TrainConfig)
    parser = OneLineParser(prog="python -m minidist.train", description=DESCRIPTION,
                           argument_default=argparse.SUPPRESS)  # absent flags stay absent: they must not override TOML
    parser.add_argument("--config", metavar="FILE", help="TOML file of settings (flags override it)")
    for flag, text in FLAGS:
        key = flag[2:].replace("-", "_")
        kind = next(t for t in (typing.get_args(hints[key]) or (hints[key],)) if t is not type(None))
        parser.add_argument(flag, type=kind, metavar=key.upper(), help=f"{text} (default: {getattr(defaults, key)})")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT")
    parser.add_argument("--overwrite", action="store_true", help="replace the run in OUT (only the trainer's "
                        "files: checkpoints/, metrics.jsonl, run.json, loss.png); without it a run there is refused")
    parser.add_argument("--sp", action="store_true", help="sequence parallel: outside the tensor-parallel regions "
                        "(norms, residual stream) each tp rank holds a slice of the sequence (needs --tp > 1)")
    parser.add_argument("--tp-reduce-fp32", action="store_true",
                        help="sum tensor-parallel partial results in fp32 (matters under --dtype bf16)")
    parser.add_argument("--compile", action="store_const", const=True, help="torch.compile each transformer block "
                        "(inductor; on a CPU it needs a C++ compiler). Default: on CUDA (with Triton), off elsewhere")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="run the blocks eagerly")
    parser.add_argument("--no-plot", dest="plot", action="store_false", help="do not draw OUT/loss.png")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any setting, TOML syntax for the value: --set model.n_layers=2 --set lr=1e-3")
    return parser


def parse_config(argv: Sequence[str] | None = None) -> TrainConfig:
    """Defaults < the --config TOML file < flags < --set items, in that order; checked before it is returned."""
    args = vars(build_parser().parse_args(argv))
    values: dict[str, Any] = {}
    if "config" in args:
        values = _merge(values, read_toml(args.pop("config")))
    sets = args.pop("set")
    if "model" in args:
        args["model"] = {"preset": args["model"]}
    values = _merge(values, args)
    for item in sets:
        values = _merge(values, _parse_set(item))
    cfg = config_from_values(values)
    check_config(cfg)
    return cfg


def read_toml(path: str) -> dict[str, Any]:
    if not Path(path).exists():
        raise ConfigError(f"config file {path!r} does not exist")
    if not Path(path).is_file():  # a directory, or a device or pipe that could be read forever
        raise ConfigError(f"config file {path!r} is not a regular file")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"config file {path!r} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path!r} is not UTF-8 text (byte {e.start}); is it a binary file?") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path!r} is not valid TOML: {e}") from None


def _parse_set(item: str) -> dict[str, Any]:
    """'model.n_layers=2' -> {'model': {'n_layers': 2}}; the value is read as TOML, else kept as a string."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {item!r} is not KEY=VALUE (e.g. --set model.n_layers=2)")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    for part in reversed(key.strip().split(".")):
        value = {part: value}
    return value


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def config_from_values(values: dict[str, Any]) -> TrainConfig:
    """A TrainConfig from TOML-shaped values ({"steps": 10, "model": {"preset": "tiny", "n_layers": 2}})."""
    values = dict(values)
    model = values.pop("model", {})
    model = {"preset": model} if isinstance(model, str) else dict(model) if isinstance(model, dict) else model
    if not isinstance(model, dict):
        raise ConfigError(f"model must be a preset name or a table, got {model!r}")
    hints = typing.get_type_hints(TrainConfig)
    known = sorted(set(hints) - {"model", "model_overrides"})
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ConfigError(f"unknown setting(s) {unknown}; known: {known} and a [model] table")
    kwargs = {key: _coerce(key, value, hints[key]) for key, value in values.items()}
    if isinstance(kwargs.get("out"), str):  # '~/x' quoted past the shell: the same directory for checks and writes
        kwargs["out"] = os.path.expanduser(kwargs["out"])
    preset = model.pop("preset", TrainConfig.model)
    return TrainConfig(model=_coerce("model.preset", preset, str), model_overrides=model, **kwargs)


def config_to_values(cfg: TrainConfig) -> dict[str, Any]:
    """The inverse of `config_from_values` (what run.json and checkpoints record)."""
    values = dataclasses.asdict(cfg)
    values["model"] = {"preset": values.pop("model"), **values.pop("model_overrides")}
    return values


def _coerce(key: str, value: Any, hint: Any) -> Any:
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
    overrides = _typed_fields(ModelConfig, cfg.model_overrides, "model")
    try:
        return get_preset(cfg.model, **overrides)
    except (ValueError, TypeError) as e:
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
            typed[key] = _coerce(name, value, hint)
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
    _check_ranges(cfg)
    _check_batch_and_model(cfg, mcfg)
    _check_choices(cfg)
    _check_combinations(cfg)
    _check_data(cfg)
    try:
        if cfg.compile:  # asked for; the default (None) compiles only where it can (blocks.resolve_compile)
            check_can_compile(cfg.device)
        if cfg.inject_fault is not None:
            parse_fault(cfg.inject_fault)  # the spec's form; its step and rank are checked against the run later
    except ValueError as e:
        raise ConfigError(str(e)) from None
    lr_schedule(cfg)  # its own checks (lr >= min_lr >= 0)
    return mcfg


# The lowest value of each integer setting.
AT_LEAST = {"steps": 1, "batch_size": 1, "seq_len": 1, "microbatches": 1, "eval_batches": 1, "log_every": 1,
            "eval_every": 0, "ckpt_every": 0, "warmup_steps": 0, "zero": 0, "tp": 1, "pp": 1, "cp": 1, "ep": 1,
            "virtual_stages": 1, "keep": 1, "check_every": 0, "loss_chunk": 0, "fp8_block": 1}


MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.001, 7 * 24 * 3600.0


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
            raise ConfigError(f"{key} must be between {MIN_TIMEOUT_S} and {MAX_TIMEOUT_S} seconds (one week), got "
                              f"{getattr(cfg, key)}")
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
    if mcfg.vocab_size < VOCAB_SIZE:
        raise ConfigError(f"model vocab_size {mcfg.vocab_size} is below the {VOCAB_SIZE} byte tokens of the data")


def _check_choices(cfg: TrainConfig) -> None:
    """Each named choice against the list its owner keeps (precision, schedules, context parallel, devices)."""
    for key, allowed in (("dtype", DTYPES), ("fp8", ("none", *FP8_RECIPES)), ("recompute", RECOMPUTE),
                         ("device", DEVICES), ("schedule", ALL_SCHEDULES), ("cp_impl", CP_IMPLS)):
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
    if cfg.recompute == "selective" and cfg.cp > 1:
        raise ConfigError("--recompute selective with --cp > 1: the ring's attention runs one kernel per block of "
                          "keys, and the policy would keep every block's output; use --recompute full or --cp 1")


def _check_data(cfg: TrainConfig) -> None:
    path = Path(cfg.data).expanduser()
    if cfg.data != "stdlib" and not any(c in cfg.data for c in "*?[") and not path.exists():
        raise ConfigError(f"data path {cfg.data!r} does not exist; give a text file, a directory, a glob, "
                          "a .bin/.npy file, or 'stdlib'")
    if cfg.data != "stdlib" and path.exists() and not (path.is_file() or path.is_dir()):  # would never finish reading
        raise ConfigError(f"data path {cfg.data!r} is not a regular file or a directory (a FIFO or a device?)")


def lr_schedule(cfg: TrainConfig) -> WarmupCosine:
    try:
        return WarmupCosine(cfg.lr, cfg.min_lr, cfg.warmup_steps, cfg.steps)
    except ValueError as e:
        raise ConfigError(str(e)) from None
