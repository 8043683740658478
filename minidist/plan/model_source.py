"""The model a plan is for (`--model PRESET|config.json|model.toml` and `--set model.FIELD=VALUE`, chapter 12): a
preset, a Hugging Face config.json (`model.hf_config.planned_config`: Llama/Mistral-style dense, DeepSeek-V3-style
MoE + MLA), or a minidist TOML model table (the trainer's `[model]` table, with an optional `preset` to start
from, or the same fields at the top of the file); every source read as untrusted input, sizes capped
(`hf_config.check_sizes`) before anything is counted or built."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

from minidist.model.config import (
    ALL_PRESETS,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    RopeScalingConfig,
    config_from_dict,
    config_to_dict,
    get_preset,
)
from minidist.model.hf_config import check_sizes, planned_config

MAX_CONFIG_BYTES = 1 << 20  # a config.json is a few KiB; a larger one is not one


def _read(path: Path) -> str:
    if not path.is_file():  # a directory, a FIFO that would block, a missing file
        raise ValueError(f"--model {str(path)[:200]!r} is neither a preset ({', '.join(sorted(ALL_PRESETS))}) "
                         "nor a config.json / model TOML file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"--model {path} is {path.stat().st_size:,} bytes, more than the {MAX_CONFIG_BYTES:,} a "
                         "model config needs")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"--model {path} is not UTF-8 text (byte {e.start})") from None


def _toml_model(path: Path) -> ModelConfig:
    try:
        values = tomllib.loads(_read(path))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--model {path} is not valid TOML: {e}") from None
    table = values.get("model", values)
    if isinstance(table, str):
        table = {"preset": table}
    if not isinstance(table, dict):
        raise ValueError(f"--model {path}: [model] must be a table of model fields, got {table!r}")
    table = dict(table)
    preset = table.pop("preset", None)
    if preset is not None and preset not in ALL_PRESETS:
        raise ValueError(f"--model {path}: preset {preset!r} is unknown; choose one of {sorted(ALL_PRESETS)}")
    base = config_to_dict(get_preset(preset)) if preset else {}
    return _config(_merge(base, table), f"--model {path}")


def _config(values: dict[str, Any], where: str) -> ModelConfig:
    """A ModelConfig from plain values, its sub-tables' types and its sizes checked (one-line ValueError)."""
    try:
        cfg = config_from_dict(values)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None
    for name, cls in (("rope_scaling", RopeScalingConfig), ("mla", MLAConfig), ("moe", MoEConfig)):
        if not isinstance(getattr(cfg, name), cls):
            raise ValueError(f"{where}: {name} must be a table of {cls.__name__} fields, got {getattr(cfg, name)!r}")
    return check_sizes(cfg, where)


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _parse_set(item: str) -> dict[str, Any]:
    """'model.n_layers=80' -> {'n_layers': 80} (the value read as TOML, else kept as a string)."""
    key, eq, text = item.partition("=")
    if not eq or not key.startswith("model.") or len(key) == len("model."):
        raise ValueError(f"--set {item[:80]!r} is not model.FIELD=VALUE (e.g. --set model.n_layers=80)")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    for part in reversed(key.split(".")[1:]):
        value = {part: value}
    return value


def planned_model(spec: str, sets: list[str] = ()) -> tuple[ModelConfig, int]:
    """(the model `--model spec` and the `--set` items name, the multi-token-prediction modules its config.json
    states, 0 otherwise); one-line ValueError for anything else."""
    mtp = 0
    if Path(spec).is_dir() and (Path(spec) / "config.json").is_file():  # a Hugging Face checkpoint directory
        spec = str(Path(spec) / "config.json")
    if spec in ALL_PRESETS:
        cfg = get_preset(spec)
    elif spec.endswith(".json"):
        path = Path(spec)
        try:
            values = json.loads(_read(path))
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"--model {path} is not valid JSON: {str(e)[:120]}") from None
        cfg, mtp = planned_config(values)
    elif spec.endswith(".toml"):
        cfg = _toml_model(Path(spec))
    else:
        _read(Path(spec))  # the error for a name that is neither
        raise ValueError(f"--model {spec[:200]!r}: a model file ends in .json (a Hugging Face config) or .toml "
                         "(a minidist model table)")
    if sets:
        values = config_to_dict(cfg)
        for item in sets:
            values = _merge(values, _parse_set(item))
        cfg = _config(values, "--set")
    return cfg, mtp
