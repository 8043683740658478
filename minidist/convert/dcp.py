"""minidist runs in and out of torch.distributed.checkpoint (DCP), with torchtitan's names and RoPE layout.

    python -m minidist.convert to-dcp RUN_DIR OUT
    python -m minidist.convert from-dcp DCP_DIR OUT

to-dcp: the latest checkpoint of the run in RUN_DIR, whatever layout wrote it, gathered to full tensors
(`train.reshard.read_full`: ZeRO's flat ranges are not rectangles, so they are not DCP chunks) and saved by
`dcp.save` under torchtitan's keys (`titan_model`): the model at the top level, Adam's state as
`optimizer.state.<name>.exp_avg | exp_avg_sq | step`, and the step as `train_state.step`, all tensors (no pickled
byte items). The run's settings go beside them in OUT/minidist.json. DCP's own planner then reshards on load: an
FSDP2 model on any number of ranks loads its shards from these full tensors (tests/test_native.py does).

from-dcp: OUT becomes a run at that step which `python -m minidist.train --config OUT/run.toml --resume` (any
layout) continues. DCP_DIR's `.metadata` is read as untrusted input (`dcp_files`); every key the model and its
optimizer need must be there with its shape and dtype, or one line says which is missing or wrong.
Every problem with the input is one line on stderr and exit code 2, before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minidist.convert import dcp_files, hf_files, titan_model
from minidist.convert.hf_model import ConvertError, check_llama_family, expected_shapes
from minidist.model import ModelConfig
from minidist.train import checkpoint, reshard
from minidist.train.config import ConfigError, config_from_values, model_config

RUN_FILE = "minidist.json"  # the run's settings, beside DCP's files
RUN_TOML = "run.toml"
MOMENTS = ("exp_avg", "exp_avg_sq")
STEP_KEY = "train_state.step"


def optimizer_key(titan: str, kind: str) -> str:
    return f"optimizer.state.{titan}.{kind}"


def expected_keys(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{DCP key: (shape, dtype)} of everything a run of `cfg` keeps: weights, Adam's moments and step, the step."""
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {STEP_KEY: ((), torch.int64)}
    for name, shape in expected_shapes(cfg).items():
        titan = titan_model.titan_name(name)
        out[titan] = (tuple(shape), torch.float32)
        out |= {optimizer_key(titan, kind): (tuple(shape), torch.float32) for kind in MOMENTS}
        out[optimizer_key(titan, "step")] = ((), torch.float32)
    return out


def _check_llama(cfg: ModelConfig) -> None:
    check_llama_family(cfg)
    if cfg.tie_embeddings:
        raise ConvertError("the model ties its embeddings; torchtitan's Llama 3 has a separate lm_head.weight")


# ---------------------------------------------------------------------------------------------------------------
# to-dcp


def full_run_state(step_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """({name: weight}, {name: {exp_avg, exp_avg_sq, step}}) of a checkpoint of any layout, as full tensors."""
    weights = reshard.read_full(step_dir, "value")
    moments = {kind: reshard.read_full(step_dir, kind) for kind in MOMENTS}
    reader = reshard.PieceReader(step_dir, checkpoint.load_meta(step_dir.parent, int(step_dir.name.split("_")[1])))
    state = {}
    for name in weights:
        entry = next((e for e in reader.entries[name] if "step" in e["kinds"]), None)
        if entry is None or name not in moments["exp_avg"]:
            raise ConvertError(f"{step_dir} holds no Adam state for {name}; to-dcp exports a trained run's optimizer")
        state[name] = {kind: moments[kind][name] for kind in MOMENTS}
        state[name]["step"] = reader.tensor(entry, "step").to(torch.float32).reshape(())
    return weights, state


def to_dcp(step_dir: Path, cfg: ModelConfig, out: Path) -> int:
    """Write a run's checkpoint (`runs.latest_checkpoint`: its step dir and model) as a DCP checkpoint in OUT, a new
    directory; return its step."""
    import torch.distributed.checkpoint as dcp

    hf_files.check_new_dir(out)
    _check_llama(cfg)
    step = int(step_dir.name.split("_")[1])
    try:
        weights, adam = full_run_state(step_dir)
    except ValueError as e:
        raise ConvertError(str(e)) from None
    state: dict[str, Any] = dict(titan_model.to_titan(cfg, weights))
    for kind in (*MOMENTS, "step"):
        named = titan_model.to_titan(cfg, {n: s[kind] for n, s in adam.items()})
        state |= {optimizer_key(t, kind): v for t, v in named.items()}
    state[STEP_KEY] = torch.tensor(step, dtype=torch.int64)
    missing = sorted(set(expected_keys(cfg)) - set(state))
    if missing:
        raise ConvertError(f"{step_dir} lacks {missing[0]} ({len(missing)} keys in all) of a {cfg.n_layers}-layer run")
    dcp.save(state, storage_writer=dcp.FileSystemWriter(out))
    meta = checkpoint.load_meta(step_dir.parent, step)
    (Path(out) / RUN_FILE).write_text(json.dumps({"config": meta["config"], "step": step}, indent=1) + "\n")
    return step


# ---------------------------------------------------------------------------------------------------------------
# from-dcp


def read_run_file(dcp_dir: Path) -> dict[str, Any]:
    """The run settings to-dcp wrote beside the DCP files, as untrusted JSON."""
    path = Path(dcp_dir) / RUN_FILE
    if not path.is_file():
        raise ConvertError(f"{path} is missing: from-dcp needs the run settings to-dcp writes beside the DCP files")
    if path.stat().st_size > 2**20:
        raise ConvertError(f"{path} is over 1 MiB; a run's settings are a few kB")
    try:
        values = json.loads(path.read_text())["config"]
        if not isinstance(values, dict):
            raise TypeError("config is not an object")
        return values
    except (ValueError, KeyError, TypeError) as e:
        raise ConvertError(f"{path} is not to-dcp's run file: {type(e).__name__}: {e}") from None


def check_keys(have: dict[str, tuple], want: dict[str, tuple], where: Path) -> None:
    """One line for the first key `want` lacks or holds with another shape or dtype."""
    missing = [k for k in want if k not in have]
    if missing:
        raise ConvertError(f"{where} lacks {missing[0]}" + (f" and {len(missing) - 1} more keys" if len(missing) > 1
                                                            else "") + " that this run needs")
    for key, (shape, dtype) in want.items():
        if have[key] != (shape, dtype):
            raise ConvertError(f"{where}: {key} is {list(have[key][0])} {have[key][1]}, this run needs "
                               f"{list(shape)} {dtype}")


def read_dcp(dcp_dir: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Every key `expected_keys(cfg)` names, loaded from DCP_DIR by DCP's planner through the safe reader."""
    import torch.distributed.checkpoint as dcp

    want = expected_keys(cfg)
    check_keys(dcp_files.tensor_shapes(dcp_files.read_metadata(dcp_dir)), want, dcp_dir)
    state = {k: torch.empty(shape, dtype=dtype, device="cpu") for k, (shape, dtype) in want.items()}
    dcp.load(state, storage_reader=dcp_files.safe_reader(dcp_dir))
    return state


def from_dcp(dcp_dir: Path, run_out: Path, settings_toml: Callable[[Any], str]) -> Path:
    """Make RUN_OUT a run at DCP_DIR's step holding its weights and Adam state; return the TOML to resume with,
    written by `settings_toml(config)` (`runs.finetune_toml`)."""
    values = read_run_file(dcp_dir)
    try:
        cfg = dataclasses.replace(config_from_values(values), out=str(run_out), resume=False, overwrite=False,
                                  stop_after=0)  # the run continues to its --steps
        mcfg = model_config(cfg)
    except (ConfigError, ValueError, TypeError) as e:
        raise ConvertError(f"{Path(dcp_dir) / RUN_FILE}: {e}") from None
    _check_llama(mcfg)
    from minidist.train import run_dir

    try:
        run_dir.check_out(cfg)
    except ConfigError as e:
        raise ConvertError(str(e)) from None
    state = read_dcp(dcp_dir, mcfg)
    step = int(state[STEP_KEY])
    if not 0 <= step <= cfg.steps:
        raise ConvertError(f"{dcp_dir}: {STEP_KEY} is {step}, outside the run's 0..{cfg.steps} steps")
    weights = titan_model.from_titan(mcfg, {t: state[t] for t in map(titan_model.titan_name, expected_shapes(mcfg))})
    adam = {kind: titan_model.from_titan(mcfg, {t: state[optimizer_key(t, kind)]
                                                for t in map(titan_model.titan_name, expected_shapes(mcfg))})
            for kind in (*MOMENTS, "step")}
    text = settings_toml(cfg)
    _save_run_at(dataclasses.replace(cfg, device="cpu"), weights, adam, step)
    path = Path(run_out) / RUN_TOML
    path.write_text(text)
    return path


def _save_run_at(cfg: Any, weights: dict[str, torch.Tensor], adam: dict[str, dict[str, torch.Tensor]],
                 step: int) -> None:
    """The one-process trainer's run with these weights and Adam state, saved as its checkpoint after `step` steps."""
    from minidist.comm.bootstrap import DistEnv, init_distributed
    from minidist.train import loop as train
    from minidist.train import run_state
    from minidist.train.preflight import resolve_layout

    env = DistEnv(rank=0, world_size=1, local_rank=0)
    device = torch.device("cpu")
    layout = resolve_layout(cfg, 1)
    topo, _ = init_distributed(layout.dims, env, device)
    run = train.setup(cfg, layout, env, topo, device)
    model, optimizer = run.parallel.model, run.parallel.optimizer
    with torch.no_grad():
        missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:  # a bug of this module, not of the input
        raise RuntimeError(f"converted state does not fit the trainer's model: missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]}")
    for name, param in model.named_parameters():
        optimizer.state[param] = {kind: adam[kind][name].clone() for kind in ("step", *MOMENTS)}
    run.sampler.step = step
    run_state.save_run(run, step)
