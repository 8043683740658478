"""The trainer's configuration read: `TrainConfig` (minidist.train.settings) from defaults < a TOML file <
command-line flags < `--set` items (`parse_config`), checked by `check_config` (minidist.train.config_checks). A bad
value is a one-line `ConfigError`; the command line prints it and exits with code 2. This module re-exports the
names callers need from the other two, so `from minidist.train.config import ...` stays the one place to import from.
"""

from __future__ import annotations

import argparse
import difflib
import os
import tomllib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from minidist.model.config import ALL_PRESETS
from minidist.train.config_checks import check_config, coerce_setting, lr_schedule, model_config
from minidist.train.settings import ConfigError, RankConfigError, TrainConfig, config_to_values

__all__ = ["DESCRIPTION", "FLAGS", "ConfigError", "OneLineParser", "RankConfigError", "TrainConfig", "build_parser",
           "check_config", "config_from_values", "config_to_values", "lr_schedule", "model_config", "parse_config",
           "read_toml"]

DESCRIPTION = ("The trainer: `python -m minidist.train` on one process, "
               "`torchrun --nproc_per_node=N -m minidist.train` on N.")


# (flag, help). The flag's key is the flag without dashes, '-' -> '_'; type and default come from TrainConfig.
FLAGS: list[tuple[str, str]] = [
    ("--model", f"model preset: {', '.join(sorted(ALL_PRESETS))}; override fields with --set model.KEY=V"),
    ("--data", "text source: 'stdlib', a text file, a directory, a glob, a .bin (uint8) or .npy file; or a dataset "
               "directory (python -m minidist.data prepare: its tokenizer sets the model's vocab_size)"),
    ("--max-bytes", "read at most this many bytes of a text source (quick runs)"),
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
    ("--attention-kernel", "the attention core: sdpa (PyTorch's fused kernels) or triton (chapter 19's "
                           "FlashAttention-2, minidist/kernels/; on a CPU only under TRITON_INTERPRET=1 set before "
                           "the start; not with --cp > 1)"),
    ("--device", "auto (cuda if available), cpu or cuda"),
    ("--compile-backend", "torch.compile's backend with --compile: inductor (generated kernels; a C++ compiler on a "
                          "CPU), aot_eager (dynamo and AOTAutograd, no code generation: CUDA's compiled path "
                          "rehearsed on a CPU), eager (dynamo's graphs only)"),
    ("--expert-backend", "routed MoE experts' kernel: auto (torch._grouped_mm where CUDA's contract holds: bf16, "
                         "16-byte aligned rows; else a loop over experts), loop, grouped_mm (torch._grouped_mm)"),
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
    ("--profile-steps", "A:B: a torch.profiler trace per rank of steps A..B (0-based, as metrics.jsonl counts them, "
                        "both included) in OUT/profile/rank{R}_steps{A}-{B}.json, for Perfetto or chrome://tracing"),
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
        self.exit(2, f"error: {message}{self.did_you_mean(message)} (see --help)\n")

    def did_you_mean(self, message: str) -> str:
        """'; did you mean --batch-size?' for an unrecognized --batch_size (or another near miss)."""
        if not message.startswith("unrecognized arguments:"):
            return ""
        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        for word in message.split(":", 1)[1].split():
            if word.startswith("--"):
                name = word.split("=", 1)[0]
                close = difflib.get_close_matches(name.replace("_", "-"), flags, n=1, cutoff=0.75)
                if close:
                    return f"; did you mean {close[0]}?"
        return ""


def build_parser() -> argparse.ArgumentParser:
    defaults = TrainConfig()
    hints = typing.get_type_hints(TrainConfig)
    parser = OneLineParser(prog="python -m minidist.train", description=DESCRIPTION,
                           argument_default=argparse.SUPPRESS)  # absent flags stay absent: they must not override TOML
    parser.add_argument("--config", metavar="FILE", help="TOML file of settings (flags override it)")
    for flag, text in FLAGS:
        key = flag[2:].replace("-", "_")
        kind = next(t for t in (typing.get_args(hints[key]) or (hints[key],)) if t is not type(None))
        default = "" if "default" in text else f" (default: {getattr(defaults, key)})"  # the text states its own
        parser.add_argument(flag, type=kind, metavar=key.upper(), help=f"{text}{default}")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT")
    parser.add_argument("--overwrite", action="store_true", help="replace the run in OUT (only the trainer's "
                        "files: checkpoints/, metrics.jsonl, run.json, loss.png); without it a run there is refused")
    parser.add_argument("--doc-mask", action="store_true", help="documents stay apart: attention within each "
                        "document (block-diagonal causal mask), RoPE positions restarting at each; targets unchanged")
    parser.add_argument("--sp", action="store_true", help="sequence parallel: outside the tensor-parallel regions "
                        "(norms, residual stream) each tp rank holds a slice of the sequence (needs --tp > 1)")
    parser.add_argument("--tp-reduce-fp32", action="store_true",
                        help="sum tensor-parallel partial results in fp32 (matters under --dtype bf16)")
    parser.add_argument("--compile", action="store_const", const=True, help="torch.compile each transformer block "
                        "(--compile-backend; inductor on a CPU needs a C++ compiler). Default: on CUDA (with Triton), "
                        "off elsewhere")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="run the blocks eagerly")
    parser.add_argument("--no-plot", dest="plot", action="store_false", help="do not draw OUT/loss.png")
    parser.add_argument("--tensorboard", action="store_true", help="also write the figures of metrics.jsonl as "
                        "TensorBoard events in OUT/tensorboard/ (needs: pip install -e '.[tensorboard]')")
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
    kwargs = {key: coerce_setting(key, value, hints[key]) for key, value in values.items()}
    if isinstance(kwargs.get("out"), str):  # '~/x' quoted past the shell: the same directory for checks and writes
        kwargs["out"] = os.path.expanduser(kwargs["out"])
    preset = model.pop("preset", TrainConfig.model)
    return TrainConfig(model=coerce_setting("model.preset", preset, str), model_overrides=model, **kwargs)


