"""A Hugging Face checkpoint directory on disk: config.json and the weights, read as untrusted input, written fresh.

Read: `config.json` (JSON, at most 1 MiB) and one of, in this order, `model.safetensors`,
`model.safetensors.index.json` (shards), `pytorch_model.bin`, `pytorch_model.bin.index.json`. safetensors files
are parsed by the `safetensors` package (a JSON header and raw bytes: nothing executes), and every tensor's name,
dtype and shape is checked against what the config implies before its bytes are read. Torch files are read with
`torch.load(weights_only=True)` only: tensors and plain containers, never pickled code. A shard index may only
name plain file names in the same directory, each listing exactly the tensors the index assigns to it.

Write: `config.json` and one `model.safetensors` (and the tokenizer's files: `minidist.convert.hf_tokenizer`) into
a directory that is new or empty; nothing there is replaced.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from minidist.convert.hf_model import DERIVED_SUFFIX, ConvertError

CONFIG = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
MAX_JSON_BYTES = {"config.json": 1 << 20, "index": 64 << 20}
SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def read_config(hf_dir: Path) -> dict[str, Any]:
    """config.json of HF_DIR as a dict; one-line ConvertError for a missing directory or file, or bad JSON."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ConvertError(f"{hf_dir} is not a directory; give a Hugging Face checkpoint directory "
                           f"({CONFIG} and model.safetensors or pytorch_model.bin)")
    config = _read_json(hf_dir / CONFIG, MAX_JSON_BYTES["config.json"])
    if not isinstance(config, dict):
        raise ConvertError(f"{hf_dir / CONFIG} must hold a JSON object")
    return config


def read_weights(hf_dir: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """{HF name: tensor} of HF_DIR's weights. Tensors of safetensors files are checked against `shapes` (names,
    dtypes, shapes) before they are read; which of them must be there is for `from_hf_state` to say (a tied
    lm_head may be absent). Derived RoPE buffers of old checkpoints are skipped."""
    hf_dir = Path(hf_dir)
    found = [name for name in WEIGHT_FILES if (hf_dir / name).is_file()]
    if not found:
        raise ConvertError(f"{hf_dir} holds no weights; expected one of {', '.join(WEIGHT_FILES)}")
    name = found[0]
    if name.endswith(".index.json"):
        files = _shard_files(hf_dir / name, name.removesuffix(".index.json").rsplit(".", 1)[1])
    else:
        files = {name: None}
    state: dict[str, torch.Tensor] = {}
    for file, names in files.items():
        path = hf_dir / file
        part = _read_safetensors(path, shapes) if file.endswith(".safetensors") else _read_torch(path)
        derived = {n for n in (names or ()) if n.endswith(DERIVED_SUFFIX)}  # skipped when safetensors are read
        if names is not None and set(part) - derived != names - derived:
            odd = sorted((set(part) ^ names) - derived)
            raise ConvertError(f"{path} does not hold the tensors its index assigns to it (e.g. {odd[:3]})")
        twice = sorted(set(part) & set(state))
        if twice:
            raise ConvertError(f"{path} repeats tensors of another shard (e.g. {twice[:3]})")
        state.update(part)
    return state


def check_new_dir(hf_dir: Path) -> None:
    """One-line ConvertError unless HF_DIR is new or an empty directory."""
    hf_dir = Path(hf_dir)
    if hf_dir.exists() and (not hf_dir.is_dir() or any(hf_dir.iterdir())):
        raise ConvertError(f"{hf_dir} already exists and is not an empty directory; give a new directory "
                           "(nothing there is replaced)")
    parent = next(p for p in (hf_dir, *hf_dir.absolute().parents) if p.exists())
    if not parent.is_dir():
        raise ConvertError(f"{hf_dir} cannot be created: {parent} is a file")
    if not os.access(parent, os.W_OK):  # EROFS for a read-only mount, even for root
        raise ConvertError(f"{hf_dir} cannot be created: {parent} is not writable (permission or read-only mount)")


def write_hf_dir(hf_dir: Path, config: dict[str, Any], state: dict[str, torch.Tensor],
                 extra_files: dict[str, bytes] | None = None) -> None:
    """config.json and model.safetensors into HF_DIR, which must be new or empty (nothing is replaced), with
    `extra_files` ({plain name: bytes}: the tokenizer's) before config.json."""
    hf_dir = Path(hf_dir)
    check_new_dir(hf_dir)
    tmp = hf_dir / "model.safetensors.tmp"
    try:
        hf_dir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, hf_dir / "model.safetensors")
        for name, data in (extra_files or {}).items():
            (hf_dir / Path(name).name).write_bytes(data)
        # config.json last: a directory whose write was interrupted is not a loadable checkpoint.
        (hf_dir / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    except Exception as e:  # noqa: BLE001 - OSError (a full disk) or safetensors' own error for the same
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        first = (getattr(e, "strerror", None) or str(e)).splitlines() or [type(e).__name__]
        raise ConvertError(f"cannot write {hf_dir}: {first[0]} (a full disk or a read-only mount?)") from None


def _read_json(path: Path, limit: int) -> Any:
    if not path.is_file():
        raise ConvertError(f"{path} is missing; a Hugging Face checkpoint directory holds {path.name}")
    if path.stat().st_size > limit:
        raise ConvertError(f"{path} is {path.stat().st_size:,} bytes, more than the {limit:,} a {path.name} needs")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep
        raise ConvertError(f"{path} is not valid JSON: {(str(e).splitlines() or [type(e).__name__])[0]}") from None


def _shard_files(index_path: Path, suffix: str) -> dict[str, set[str]]:
    """{shard file: the tensor names the index assigns to it}; only plain names in the index's directory."""
    index = _read_json(index_path, MAX_JSON_BYTES["index"])
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConvertError(f"{index_path} has no weight_map object (tensor name -> shard file)")
    files: dict[str, set[str]] = {}
    for tensor, file in weight_map.items():
        if not isinstance(file, str) or Path(file).name != file or file.startswith(".") or \
                not file.endswith(f".{suffix}"):
            raise ConvertError(f"{index_path} maps {tensor!r} to {file!r}; shards must be plain .{suffix} file "
                               "names in the same directory")
        if not (index_path.parent / file).is_file():
            raise ConvertError(f"{index_path} names the shard {file}, which is missing")
        if (index_path.parent / file).resolve().parent != index_path.parent.resolve():  # a link out of the folder
            raise ConvertError(f"{index_path} names the shard {file}, a link to a file outside {index_path.parent}")
        files.setdefault(file, set()).add(tensor)
    return files


def _read_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            names = [name for name in f.keys() if not name.endswith(DERIVED_SUFFIX)]
            for name in names:  # the header only: nothing of a wrong tensor is read
                if name not in shapes:
                    raise ConvertError(f"{path} holds {name!r}, which a model of this config does not have")
                piece = f.get_slice(name)
                dtype, shape = piece.get_dtype(), tuple(piece.get_shape())
                if dtype not in SAFETENSORS_DTYPES:
                    raise ConvertError(f"{path}: {name} has dtype {dtype}; weights must be one of "
                                       f"{sorted(SAFETENSORS_DTYPES)}")
                if shape != tuple(shapes[name]):
                    raise ConvertError(f"{path}: {name} has shape {list(shape)}; the config implies "
                                       f"{list(shapes[name])}")
            return {name: f.get_tensor(name) for name in names}
    except ConvertError:
        raise
    except Exception as e:  # safetensors' own errors: a bad header, offsets outside the file, ...
        raise ConvertError(f"{path} is not a valid safetensors file: {str(e).splitlines()[0] if str(e) else e!r}"
                           ) from None


def _read_torch(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # weights_only refuses anything but tensors and plain data, with an UnpicklingError
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "weights only load failed" in first.lower():  # torch's advice to load it unsafely is not ours to give
            first = "it holds objects other than tensors and plain data"
        raise ConvertError(f"{path} is not a plain torch state dict (read with weights_only=True): {first}"
                           ) from None
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise ConvertError(f"{path} must hold a dict of tensor name -> tensor")
    for name, t in state.items():  # a stride-0 tensor: a few stored bytes that a copy would expand to gigabytes
        if t.untyped_storage().nbytes() < t.numel() * t.element_size():
            raise ConvertError(f"{path}: {name} has {t.numel():,} elements on {t.untyped_storage().nbytes():,} bytes "
                               "of storage (a stride-0 or overlapping tensor); weights must be dense")
    return state
