"""Hugging Face Llama checkpoints in and out of minidist runs.

    python -m minidist.convert to-hf RUN_OUT HF_DIR
    python -m minidist.convert from-hf HF_DIR RUN_OUT [--rope-layout half|interleaved] [TRAINER FLAGS ...]

to-hf: the latest checkpoint of the run in RUN_OUT, whatever layout wrote it (`minidist.train.reshard.read_full_model`
gathers the full model), as config.json + model.safetensors (fp32) in HF_DIR, loadable by
`transformers.LlamaForCausalLM.from_pretrained(HF_DIR)`, with the run's RUN_OUT/tokenizer.json beside them
(+ tokenizer_config.json) for `transformers.AutoTokenizer.from_pretrained(HF_DIR)`.

from-hf: a fine-tuning run in RUN_OUT that starts from the converted weights. The trainer flags (--data,
--batch-size, --seq-len, --steps, --lr, ...) are fixed here, because a resumed run must keep them; they are written
to RUN_OUT/finetune.toml with the model's shapes, and the weights as the step-0 checkpoint of the one-process
layout (fresh optimizer state). Then `python -m minidist.train --config RUN_OUT/finetune.toml --resume` (or
torchrun with any layout flags: the checkpoint reshards) trains it. The trainer's data are bytes, token ids 0..255.

The conversion itself is `minidist.convert.hf_model` (`to_hf_state`, `from_hf_state`), the files
`minidist.convert.hf_files`.
Every problem with the input is one line on stderr and exit code 2, before anything is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from minidist.convert import hf_files, hf_tokenizer
from minidist.convert.hf_model import ConvertError, from_hf_state, hf_shapes, model_config_from_hf, to_hf_state
from minidist.model import ModelConfig
from minidist.model.config import config_to_dict
from minidist.train import checkpoint
from minidist.train.config import (
    ConfigError,
    OneLineParser,
    config_from_values,
    config_to_values,
    model_config,
    parse_config,
)

__all__ = ["ConvertError", "from_hf", "from_hf_state", "main", "read_hf", "to_hf", "to_hf_state"]

FINETUNE_TOML = "finetune.toml"
# ModelConfig fields a Llama-family model sets (the rest keep their defaults: no MLA, no MoE)
LLAMA_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len", "mlp", "norm",
                "norm_eps", "bias", "position", "tie_embeddings", "rope_base", "rope_layout", "rope_scaling",
                "attention", "init_std")
# Trainer flags from-hf sets itself (the model, OUT, a fresh run) or leaves to the resume (the layout).
NOT_HERE = ("--model", "--out", "--config", "--resume", "--overwrite", "--dp", "--tp", "--pp", "--cp", "--ep",
            "--zero", "--sp", "--virtual-stages")


# ---------------------------------------------------------------------------------------------------------------
# to-hf


def latest_checkpoint(run_out: Path) -> tuple[Path, ModelConfig]:
    """The newest complete checkpoint directory of the run in RUN_OUT and the model config it was trained with."""
    root = Path(run_out) / "checkpoints"
    if not Path(run_out).is_dir():
        raise ConvertError(f"{run_out} is not a directory; give the --out directory of a minidist run")
    try:
        step = checkpoint.latest_step(root)
        if step is None:
            raise ConvertError(f"{root} holds no checkpoint; train with --ckpt-every (or to the end) first")
        meta = checkpoint.load_meta(root, step)
        values = meta.get("config")
        if not isinstance(values, dict):
            raise ConvertError(f"{root / checkpoint.step_dir_name(step)}/meta.json records no run config")
        return root / checkpoint.step_dir_name(step), model_config(config_from_values(values))
    except ConvertError:
        raise
    except ValueError as e:  # a damaged checkpoint (minidist.train.checkpoint) or a config the trainer refuses
        raise ConvertError(f"cannot read the checkpoint in {root}: {e}") from None


def to_hf(run_out: Path, hf_dir: Path, note: Callable[[str], None] = print) -> Path:
    """Write the latest checkpoint of RUN_OUT as a Hugging Face Llama checkpoint in HF_DIR, with the run's tokenizer
    (`minidist.convert.hf_tokenizer`; a run without one: `note` says so, the weights alone); return its step dir."""
    from minidist.train.reshard import read_full_model

    hf_files.check_new_dir(hf_dir)  # before the (long) read of the checkpoint
    step_dir, cfg = latest_checkpoint(run_out)
    tokenizer = hf_tokenizer.read_run_tokenizer(run_out, cfg.vocab_size)  # checked before anything is written
    try:
        state = read_full_model(step_dir)
    except ValueError as e:
        raise ConvertError(str(e)) from None
    config, hf_state = to_hf_state(cfg, state)
    extra = {}
    if tokenizer is not None:
        extra = hf_tokenizer.tokenizer_files(tokenizer, cfg.max_seq_len)
        config.update(hf_tokenizer.special_ids(tokenizer))
    hf_files.write_hf_dir(hf_dir, config, hf_state, extra)
    if tokenizer is None:
        note(f"note: {Path(run_out) / hf_tokenizer.TOKENIZER} is missing (a run older than the trainer's tokenizer "
             f"file: its tokens were bytes 0..255); wrote the weights only, no tokenizer in {hf_dir}")
    return step_dir


# ---------------------------------------------------------------------------------------------------------------
# from-hf


def read_hf(hf_dir: Path, rope_layout: str = "half") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The minidist ModelConfig and fp32 state of a Hugging Face Llama checkpoint directory, checked."""
    from minidist.train.preflight import memory_capacity, param_count

    config = hf_files.read_config(hf_dir)
    mcfg = model_config_from_hf(config, rope_layout)
    need, (where, have) = 8 * param_count(mcfg), memory_capacity("cpu")  # the fp32 weights, and the model built
    if need > have:  # before any tensor is read or allocated
        raise ConvertError(f"{hf_dir / hf_files.CONFIG} describes {param_count(mcfg):,} parameters: at least "
                           f"{need / 2**30:,.1f} GiB to convert, but {where} has {have / 2**30:,.1f} GiB")
    shapes = hf_shapes(mcfg)  # to check each tensor before reading it
    return from_hf_state(config, hf_files.read_weights(hf_dir, shapes), rope_layout)


def from_hf(hf_dir: Path, run_out: Path, trainer_args: Sequence[str] = (), rope_layout: str = "half") -> Path:
    """Make RUN_OUT a run at step 0 holding HF_DIR's weights; return the TOML file to resume it with."""
    for arg in trainer_args:
        flag = arg.split("=", 1)[0]
        if flag in NOT_HERE or arg.startswith("model."):
            raise ConvertError(f"from-hf sets {flag} itself or leaves it to the resumed run; give the layout "
                               "flags to `python -m minidist.train --resume`")
    cfg_model, state = read_hf(hf_dir, rope_layout)
    sets = [f"model.{k}={_toml_value(v)}" for k, v in _model_values(cfg_model).items()]
    try:  # an unknown flag: the trainer's parser prints one line and exits with code 2
        cfg = parse_config([*trainer_args, "--out", str(run_out), *(a for s in sets for a in ("--set", s))])
    except ConfigError as e:
        raise ConvertError(f"trainer settings: {e}") from None
    hf_tokenizer.check_data_tokenizer(hf_dir, cfg.data)  # the ids the model learnt are the data's
    from minidist.train import run_dir

    try:
        run_dir.check_out(cfg)  # an OUT holding a run is refused, never replaced
    except ConfigError as e:
        raise ConvertError(str(e)) from None
    if (Path(run_out) / FINETUNE_TOML).exists():
        raise ConvertError(f"{Path(run_out) / FINETUNE_TOML} exists; give a new RUN_OUT (nothing is replaced)")
    text = finetune_toml(cfg)
    _save_step0(dataclasses.replace(cfg, device="cpu"), state)
    path = Path(run_out) / FINETUNE_TOML
    path.write_text(text)
    return path


def _model_values(cfg: ModelConfig) -> dict[str, Any]:
    values = config_to_dict(cfg)
    return {k: values[k] for k in LLAMA_FIELDS}


def _save_step0(cfg: Any, state: dict[str, torch.Tensor]) -> None:
    """The one-process trainer's run state with `state` as its weights, saved as the checkpoint of step 0."""
    from minidist.comm.bootstrap import DistEnv, init_distributed
    from minidist.train import loop as train
    from minidist.train import run_state
    from minidist.train.preflight import resolve_layout

    env = DistEnv(rank=0, world_size=1, local_rank=0)
    device = torch.device("cpu")
    layout = resolve_layout(cfg, 1)
    topo, _ = init_distributed(layout.dims, env, device)
    run = train.setup(cfg, layout, env, topo, device)
    with torch.no_grad():
        missing, unexpected = run.parallel.model.load_state_dict(state, strict=False)
    if missing or unexpected:  # a bug of this module, not of the input: say what differs
        raise RuntimeError(f"converted state does not fit the trainer's model: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    run_state.save_run(run, 0)


def finetune_toml(cfg: Any) -> str:
    """The run's settings as TOML (None values left out: they are the defaults), checked to read back equal."""
    values = config_to_values(cfg)
    for key in ("resume", "overwrite"):
        values.pop(key)
    model = values.pop("model")
    lines = [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
    lines += ["", "[model]"] + [f"{k} = {_toml_value(v)}" for k, v in model.items() if v is not None]
    text = "# written by `python -m minidist.convert from-hf`; continue with\n" \
           "# python -m minidist.train --config THIS_FILE --resume  (plus any layout flags)\n" + "\n".join(lines) + "\n"
    if config_from_values(tomllib.loads(text)) != dataclasses.replace(cfg, resume=False, overwrite=False):
        raise RuntimeError("finetune.toml does not read back as the run's settings")  # a bug of _toml_value
    return text


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConvertError(f"setting {value} is not a finite number")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"no TOML form for {value!r}")


# ---------------------------------------------------------------------------------------------------------------
# the command line


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m minidist.convert",
                           description=__doc__.split("\n\nThe conversion itself")[0],
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog="Supported: Llama-family models (SwiGLU, RMSNorm, RoPE, no biases, MHA/GQA/MQA, tied "
                                  "or untied embeddings,\nrope_type default, linear or yarn). Refused in one line: "
                                  "other architectures, biases, other activations,\nattention dropout, other RoPE "
                                  "types.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    to = sub.add_parser("to-hf", help="the latest checkpoint of a run (any layout) -> a Hugging Face directory",
                        description="Write the latest checkpoint of RUN_OUT (any parallel layout) as config.json + "
                                    "model.safetensors (fp32) for transformers' LlamaForCausalLM, and the run's "
                                    "tokenizer.json (+ tokenizer_config.json) for AutoTokenizer.")
    to.add_argument("run_out", type=Path, metavar="RUN_OUT", help="the --out directory of a minidist run")
    to.add_argument("hf_dir", type=Path, metavar="HF_DIR", help="a new (or empty) directory")
    fr = sub.add_parser("from-hf", help="a Hugging Face Llama directory -> a run that `train --resume` fine-tunes",
                        description="Read HF_DIR (config.json + model.safetensors, sharded safetensors or "
                                    "pytorch_model.bin) and make RUN_OUT a run at step 0 holding its weights. "
                                    "Trainer flags after RUN_OUT (e.g. --data, --steps, --lr, --batch-size, "
                                    f"--seq-len) are fixed for the run and written to RUN_OUT/{FINETUNE_TOML}; "
                                    f"continue with: python -m minidist.train --config RUN_OUT/{FINETUNE_TOML} "
                                    "--resume [layout flags such as --tp 2].")
    fr.add_argument("hf_dir", type=Path, metavar="HF_DIR", help="a Hugging Face Llama checkpoint directory")
    fr.add_argument("run_out", type=Path, metavar="RUN_OUT", help="a new directory for the run")
    fr.add_argument("--rope-layout", choices=("half", "interleaved"), default="half",
                    help="RoPE layout of the minidist model (half: HF's, no permutation; interleaved: q/k rows "
                         "permuted by chapter 03's permutation)")
    _add_dcp_commands(sub)
    return parser


def _add_dcp_commands(sub) -> None:
    """to-dcp / from-dcp (minidist.convert.dcp)."""
    to = sub.add_parser("to-dcp", help="the latest checkpoint of a run (any layout) -> a torch.distributed.checkpoint "
                                       "directory with torchtitan's names",
                        description="Write the latest checkpoint of RUN_DIR (any layout): weights and Adam state, "
                                    "full tensors under torchtitan's Llama 3 names and RoPE layout, by dcp.save; the "
                                    "run's settings in OUT/minidist.json.")
    to.add_argument("run_out", type=Path, metavar="RUN_DIR", help="the --out directory of a minidist run")
    to.add_argument("dcp_dir", type=Path, metavar="OUT", help="a new (or empty) directory")
    fr = sub.add_parser("from-dcp", help="a DCP directory written by to-dcp (or resharded since) -> a run that "
                                         "`train --resume` continues",
                        description="Read DCP_DIR (its .metadata as untrusted input) and make OUT a run at its step; "
                                    "continue with: python -m minidist.train --config OUT/run.toml --resume "
                                    "[layout flags].")
    fr.add_argument("dcp_dir", type=Path, metavar="DCP_DIR", help="a DCP checkpoint directory with minidist.json")
    fr.add_argument("run_out", type=Path, metavar="OUT", help="a new directory for the run")


def _run_dcp_command(args) -> None:
    from minidist.convert import dcp

    if args.command == "to-dcp":
        hf_files.check_new_dir(args.dcp_dir)  # before the (long) read of the checkpoint
        step_dir, cfg = latest_checkpoint(args.run_out)
        step = dcp.to_dcp(step_dir, cfg, args.dcp_dir)
        print(f"wrote {args.dcp_dir} (step {step}) from {step_dir}")
    else:
        toml = dcp.from_dcp(args.dcp_dir, args.run_out, finetune_toml)
        print(f"wrote {args.run_out}; continue with: python -m minidist.train --config {toml} --resume")


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = build_parser().parse_known_args(argv)
    try:
        if args.command in ("to-dcp", "from-dcp"):
            if rest:
                raise ConvertError(f"{args.command} takes no other arguments, got {' '.join(rest)}")
            _run_dcp_command(args)
        elif args.command == "to-hf":
            if rest:
                raise ConvertError(f"to-hf takes no other arguments, got {' '.join(rest)}")
            step_dir = to_hf(args.run_out, args.hf_dir, note=lambda line: print(line, file=sys.stderr))
            print(f"wrote {args.hf_dir} from {step_dir}")
        else:
            toml = from_hf(args.hf_dir, args.run_out, rest, args.rope_layout)
            print(f"wrote {args.run_out} (step 0 = {args.hf_dir}); fine-tune with: "
                  f"python -m minidist.train --config {toml} --resume")
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0

