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
silent difference. Every shard's largest token id is read too (in the same pass as its hash; alone when
`verify=False`) and must lie inside the vocabulary, and the manifest's vocabulary must be its tokenizer's (largest
id + 1): an id past the embedding is a one-line error before any process group, not an IndexError (a device-side
assert on CUDA) mid-run. A directory holding a dataset's files but no manifest (a killed prepare) is refused, never
read as text. `python -m minidist.data verify DIR` runs the same check on its own. `manifest_sha256` (the
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

from minidist.data.prepare import DATASET_FILE, FORMAT, VERSION
from minidist.data.shards import TokenShards
from minidist.data.tokenizer import MAX_TOKENIZER_BYTES, MAX_VOCAB, vocab_of

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
    """Whether `path` is (or looks like) a prepared dataset directory, not a text source: it holds a manifest.json
    (a link or a FIFO too: `read_manifest` refuses those) or any file a prepare writes (an interrupted prepare
    leaves no manifest: refused too, never read as text)."""
    if path is None:
        return False
    root = Path(os.path.expanduser(str(path)))
    return root.is_dir() and (os.path.lexists(root / "manifest.json") or bool(dataset_files(root)))


def dataset_files(root: Path) -> list[str]:
    """The names in `root` that a prepare writes (shards, document indexes, tokenizer.json), sorted."""
    with os.scandir(root) as entries:
        return sorted(e.name for e in entries if DATASET_FILE.fullmatch(e.name))


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
    if not os.path.lexists(root / "manifest.json") and root.is_dir():
        raise ValueError(f"{root} holds a dataset's files ({', '.join(dataset_files(root)[:3])}) but no manifest.json "
                         "(an interrupted prepare?); prepare it again with --overwrite")
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
    limit = min(2 ** (8 * DTYPES[m["dtype"]].itemsize), MAX_VOCAB)
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
    return scan(path, size)[0]


def scan(path: Path, size: int, dtype: np.dtype | None = None, digest: bool = True) -> tuple[str, int]:
    """(SHA-256, largest token id) of the first `size` bytes of `path`, read once in chunks of `_CHUNK` bytes
    into one buffer (bounded memory whatever the file); the id is -1 without a `dtype` or for no tokens."""
    h, top = hashlib.sha256(), -1
    buffer = bytearray(min(_CHUNK, max(size, 0)))
    with open(path, "rb") as f:
        while size > 0:
            view = memoryview(buffer)[: min(_CHUNK, size)]
            got = f.readinto(view)
            if not got:
                break
            if digest:
                h.update(view[:got])
            if dtype is not None and got >= dtype.itemsize:
                top = max(top, int(np.frombuffer(view[: got - got % dtype.itemsize], dtype=dtype).max()))
            size -= got
    return h.hexdigest(), top


def verify_hashes(root: Path, m: dict, digest: bool = True) -> None:
    """Every file the manifest names against its recorded SHA-256 (sizes checked first by `_check_sizes`), and
    every shard's largest id against the vocabulary, in one read of each file (`digest=False`: the ids only)."""
    dtype = DTYPES[m["dtype"]]
    tok = root / m["tokenizer"]["file"]
    files = [(tok, tok.stat().st_size, m["tokenizer"]["sha256"], "tokenizer")] if digest else []
    for split in m["splits"].values():
        files += [(root / s["file"], s["tokens"] * dtype.itemsize, s["sha256"], "shard") for s in split["shards"]]
        docs = split["documents"]
        files += [(root / docs["file"], 8 * docs["count"], docs["sha256"], "document index")] if digest else []
    for path, size, want, what in files:
        got, top = scan(path, size, dtype if what == "shard" else None, digest)
        if digest and got != want:
            raise ValueError(f"{root}: {what} {path.name!r} does not match its SHA-256 in the manifest (changed or "
                             "damaged since prepare); prepare the dataset again")
        if top >= m["vocab_size"]:
            raise ValueError(f"{root}: shard {path.name!r} holds token id {top:,}, outside the vocabulary of "
                             f"{m['vocab_size']:,} (ids 0..{m['vocab_size'] - 1:,}); prepare the dataset again")


def open_dataset(root: str | os.PathLike, verify: bool = True) -> Dataset:
    """The dataset at `root` checked as the module docstring says; its splits as `shards.TokenShards` streams."""
    root = Path(os.path.expanduser(str(root)))
    manifest, digest = read_manifest(root)
    _check_sizes(root, manifest)
    verify_hashes(root, manifest, digest=verify)  # the ids are read either way: an id past the embedding
    dtype = DTYPES[manifest["dtype"]]
    splits = {name: TokenShards([root / s["file"] for s in split["shards"]], [s["tokens"] for s in split["shards"]],
                                dtype) for name, split in manifest["splits"].items()}
    tokenizer_json = read_tokenizer(root, manifest)
    ids = vocab_of(tokenizer_json)
    if ids != manifest["vocab_size"]:  # the model's rows come from the manifest, the ids from the tokenizer
        raise ValueError(f"{root}: the manifest's vocab_size {manifest['vocab_size']:,} is not the {ids:,} ids of its "
                         f"tokenizer {manifest['tokenizer']['file']!r}; prepare the dataset again")
    return Dataset(root, manifest, digest, tokenizer_json, splits)


def read_tokenizer(root: str | os.PathLike, manifest: dict | None = None) -> bytes:
    """The dataset's tokenizer.json (a regular file inside it, read bounded), checked against the manifest's
    SHA-256; `manifest` read from `root` when not given."""
    root = Path(os.path.expanduser(str(root)))
    manifest = read_manifest(root)[0] if manifest is None else manifest
    with open(_regular(root, manifest["tokenizer"].get("file"), "tokenizer"), "rb") as f:
        tokenizer_json = f.read(MAX_TOKENIZER_BYTES + 1)
    if hashlib.sha256(tokenizer_json).hexdigest() != manifest["tokenizer"]["sha256"]:
        raise ValueError(f"{root}: tokenizer {manifest['tokenizer']['file']!r} does not match its SHA-256 in the "
                         "manifest")
    return tokenizer_json
