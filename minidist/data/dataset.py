"""A prepared dataset (`minidist.data.prepare` writes one) opened for training, its manifest read as untrusted input.

`open_dataset(root)` checks, in one line each (ValueError) and before any shard is read: manifest.json is a
regular file of at most `MAX_MANIFEST_BYTES`, JSON of format "minidist-tokens" version 1; dtype, vocabulary and EOD
id consistent; every file it names a plain name inside the directory (no ``../x``, no absolute path, no link out of
it) that is a regular file (a FIFO or ``/dev/zero`` is refused by its type, never read); each shard's size equal to
its tokens times the item size; each document index the right size, its last end equal to the split's tokens (a
shard shorter than its index fails). With `verify=True` (the trainer's choice) it then hashes every file it names,
each read in chunks up to its recorded size, against the manifest's SHA-256, as a checkpoint is verified. The
cost, measured: hashlib's SHA-256 runs at 1.1 GB/s on one core of the 2-core machine this was written on, and
`bench/data.py` opened a 1 GB dataset in 1.0-2.7 s (under load): a 50 GB dataset costs each rank one to two minutes at
start, small beside a run on it, and a damaged shard is then a one-line error on every rank before any step, never a
silent difference. `python -m minidist.data verify DIR` runs the same check on its own. `manifest_sha256` (the
manifest file's hash, which covers every file through the hashes it records) and `tokenizer_sha256` identify the
dataset in a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from minidist.data.prepare import FORMAT, VERSION
from minidist.data.shards import TokenShards
from minidist.data.tokenizer import MAX_TOKENIZER_BYTES

MAX_MANIFEST_BYTES = 64 * 2**20
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
SPLITS = ("train", "val")
_CHUNK = 8 * 2**20


@dataclass
class Dataset:
    root: Path
    manifest: dict
    manifest_sha256: str
    tokenizer_json: bytes
    splits: dict[str, TokenShards]

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    @property
    def eod_id(self) -> int:
        return self.manifest["eod_id"]

    @property
    def tokenizer_sha256(self) -> str:
        return self.manifest["tokenizer"]["sha256"]


def is_prepared(path: str | os.PathLike | None) -> bool:
    """Whether `path` is a prepared dataset directory (one holding manifest.json), not a text source."""
    return path is not None and Path(os.path.expanduser(str(path)), "manifest.json").is_file()


def _regular(root: Path, name: object, what: str) -> Path:
    """root/name for a plain file name inside root that is a regular file; a one-line ValueError otherwise."""
    if not isinstance(name, str) or not name or name != Path(name).name or name in (".", ".."):
        raise ValueError(f"{root / 'manifest.json'}: {what} {name!r} is not a plain file name inside the directory")
    path = root / name
    if path.resolve().parent != root.resolve():
        raise ValueError(f"{root / 'manifest.json'}: {what} {name!r} links out of the dataset directory")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        raise ValueError(f"{root}: {what} {name!r} is missing") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{root}: {what} {name!r} is not a regular file (a FIFO or a device?)")
    return path


def read_manifest(root: str | os.PathLike) -> tuple[dict, str]:
    """(manifest, its SHA-256), the manifest's own fields checked (the files it names: `open_dataset`)."""
    root = Path(os.path.expanduser(str(root)))
    path = _regular(root, "manifest.json", "manifest")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise ValueError(f"{path} is {path.stat().st_size:,} bytes, over the {MAX_MANIFEST_BYTES:,} a manifest can be")
    with open(path, "rb") as f:
        data = f.read(MAX_MANIFEST_BYTES)
    try:
        manifest = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not JSON: {e}") from None
    _check_fields(manifest, path)
    return manifest, hashlib.sha256(data).hexdigest()


def _int(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _check_fields(m: object, path: Path) -> None:
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        found = m.get("format") if isinstance(m, dict) else type(m).__name__
        raise ValueError(f"{path} is not a {FORMAT} manifest (format {found!r})")
    if m.get("version") != VERSION:
        raise ValueError(f"{path} has version {m.get('version')!r}; this minidist reads version {VERSION}")
    if m.get("dtype") not in DTYPES:
        raise ValueError(f"{path}: dtype {m.get('dtype')!r} is unknown; expected one of {sorted(DTYPES)}")
    limit = 2 ** (8 * DTYPES[m["dtype"]].itemsize)
    if not _int(m.get("vocab_size"), 1, limit) or not _int(m.get("eod_id"), 0, m["vocab_size"] - 1):
        raise ValueError(f"{path}: vocab_size {m.get('vocab_size')!r} / eod_id {m.get('eod_id')!r} do not fit "
                         f"{m['dtype']} (vocab_size in [1, {limit}], eod_id below it)")
    tok, splits = m.get("tokenizer"), m.get("splits")
    if not isinstance(tok, dict) or not isinstance(tok.get("sha256"), str):
        raise ValueError(f"{path}: 'tokenizer' must be a table with file and sha256")
    if not isinstance(splits, dict) or "train" not in splits or set(splits) - set(SPLITS):
        raise ValueError(f"{path}: 'splits' must hold 'train' (and 'val'), got {list(splits or [])}")
    for name, split in splits.items():
        shards, docs = split.get("shards") if isinstance(split, dict) else None, (split or {}).get("documents")
        if (not isinstance(shards, list) or not all(isinstance(s, dict) and _int(s.get("tokens"), 0, 2**62)
                                                    and isinstance(s.get("sha256"), str) for s in shards)
                or not _int(split.get("tokens"), 0, 2**62) or not isinstance(docs, dict)
                or not _int(docs.get("count"), 0, 2**62) or not isinstance(docs.get("sha256"), str)):
            raise ValueError(f"{path}: split {name!r} lacks tokens, shards [{{file, tokens, sha256}}] or documents")
        if sum(s["tokens"] for s in shards) != split["tokens"]:
            raise ValueError(f"{path}: split {name!r} says {split['tokens']:,} tokens but its shards hold "
                             f"{sum(s['tokens'] for s in shards):,}")


def _check_sizes(root: Path, m: dict) -> None:
    """Every named file a regular file inside root whose size the manifest implies."""
    item = DTYPES[m["dtype"]].itemsize
    _regular(root, m["tokenizer"].get("file"), "tokenizer")
    for name, split in m["splits"].items():
        for shard in split["shards"]:
            size = _regular(root, shard.get("file"), "shard").stat().st_size
            if size != shard["tokens"] * item:
                raise ValueError(f"{root}: shard {shard['file']!r} is {size:,} bytes but the manifest says "
                                 f"{shard['tokens']:,} tokens of {item} bytes")
        docs = split["documents"]
        index = _regular(root, docs.get("file"), "document index")
        if index.stat().st_size != 8 * docs["count"]:
            raise ValueError(f"{root}: document index {docs['file']!r} is {index.stat().st_size:,} bytes, not 8 x "
                             f"{docs['count']:,} documents")
        last = int(np.fromfile(index, dtype="<i8", offset=8 * (docs["count"] - 1))[0]) if docs["count"] else 0
        if last != split["tokens"]:
            raise ValueError(f"{root}: split {name!r}: the document index ends at token {last:,} but the shards hold "
                             f"{split['tokens']:,}")


def sha256_bounded(path: Path, size: int) -> str:
    """SHA-256 of the first `size` bytes of `path`, read in chunks (never more than `size`)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while size > 0:
            chunk = f.read(min(_CHUNK, size))
            if not chunk:
                break
            h.update(chunk)
            size -= len(chunk)
    return h.hexdigest()


def verify_hashes(root: Path, m: dict) -> None:
    """Every file the manifest names against its recorded SHA-256 (sizes checked first by `_check_sizes`)."""
    tok = root / m["tokenizer"]["file"]
    files = [(tok, tok.stat().st_size, m["tokenizer"]["sha256"], "tokenizer")]
    for split in m["splits"].values():
        files += [(root / s["file"], s["tokens"] * DTYPES[m["dtype"]].itemsize, s["sha256"], "shard")
                  for s in split["shards"]]
        docs = split["documents"]
        files.append((root / docs["file"], 8 * docs["count"], docs["sha256"], "document index"))
    for path, size, want, what in files:
        if sha256_bounded(path, size) != want:
            raise ValueError(f"{root}: {what} {path.name!r} does not match its SHA-256 in the manifest (changed or "
                             "damaged since prepare); prepare the dataset again")


def open_dataset(root: str | os.PathLike, verify: bool = True) -> Dataset:
    """The dataset at `root` checked as the module docstring says; its splits as `shards.TokenShards` streams."""
    root = Path(os.path.expanduser(str(root)))
    manifest, digest = read_manifest(root)
    _check_sizes(root, manifest)
    if verify:
        verify_hashes(root, manifest)
    dtype = DTYPES[manifest["dtype"]]
    splits = {name: TokenShards([root / s["file"] for s in split["shards"]], [s["tokens"] for s in split["shards"]],
                                dtype) for name, split in manifest["splits"].items()}
    with open(root / manifest["tokenizer"]["file"], "rb") as f:
        tokenizer_json = f.read(MAX_TOKENIZER_BYTES + 1)
    if hashlib.sha256(tokenizer_json).hexdigest() != manifest["tokenizer"]["sha256"]:
        raise ValueError(f"{root}: tokenizer {manifest['tokenizer']['file']!r} does not match its SHA-256 in the "
                         "manifest")
    return Dataset(root, manifest, digest, tokenizer_json, splits)
