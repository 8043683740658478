"""Text sources read as bytes: a byte tokenizer and a corpus that needs no download (the sampler: `sampler.py`;
tokenized datasets on disk: `prepare.py`, `dataset.py`).

Tokens are bytes (vocabulary 256), so tokenizing is the identity on UTF-8 bytes and a corpus is a uint8 tensor.

Sources accepted by `load_corpus`:

- ``None`` or ``"stdlib"``: the ``.py`` files of the running Python's standard library
  (``sysconfig.get_paths()["stdlib"]``), about 12 MB of real, varied text. Left out: ``site-packages`` and
  ``dist-packages`` (third-party code that differs from machine to machine), the test suites (directories named
  ``test``, ``tests``, ``idle_test``: 2.5x the size of the library and full of deliberately odd files), build
  leftovers (``config-*`` directories, the generated ``_sysconfigdata*.py``), ``__pycache__`` and hidden entries.
- a directory: every regular file below it, recursively, except hidden files and folders and binary files (a NUL
  byte in the first 8 KiB, git's rule).
- a glob pattern (``"notes/**/*.md"``): the matching regular files, taken as they are.
- a text file: its bytes.
- a ``.bin`` file: raw uint8 tokens, one byte per token, no header (what ``open(p, "wb").write(text.encode())``
  or ``np.asarray(ids, np.uint8).tofile(p)`` writes). With byte-level tokens this is the same data as a text file.
- a ``.npy`` file: a 1-D integer array of token ids, each in [0, 256).

Train/validation split. Several files: split by file, so no file leaks into both. Files are ordered by a hash of
their relative path and validation takes files in that order until it holds at least ``val_fraction`` of the bytes
(never every file). Adding a file therefore moves at most the files near the cut, it does not reshuffle the rest.
One file, ``.bin`` or ``.npy``: the last ``val_fraction`` of the bytes / tokens is validation.
Files are joined with the ASCII "file separator" byte 0x1C, which never occurs in source code.

`max_bytes` is applied while reading: the standard library stops reading files at the cap; a directory or glob
lists its files by size, splits them, and reads only the head of each split that the cap keeps; a text, .bin or .npy
file is mapped and only the bytes kept are copied.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minidist.data.documents import _is_text, _val_file_indices, glob_files, stdlib_files, stdlib_root, walk_files
from minidist.data.sampler import BatchSampler

__all__ = ["BatchSampler", "ByteTokenizer", "Corpus", "FILE_SEPARATOR", "VOCAB_SIZE", "load_corpus", "stdlib_files",
           "stdlib_root", "unigram_entropy_bits", "unigram_entropy_nats"]  # BatchSampler: its home is sampler.py

VOCAB_SIZE = 256  # byte-level
FILE_SEPARATOR = b"\x1c"  # ASCII FS (file separator), placed between files in a joined corpus
# A text source is held in memory (one byte per token, and a copy while it is made a tensor): above this many bytes
# the trainer asks for --max-bytes (its head) or a prepared dataset (read from disk row by row).
MAX_TEXT_BYTES = 2**30



class ByteTokenizer:
    """UTF-8 bytes as tokens: encode is exact, decode replaces invalid byte sequences with U+FFFD."""

    vocab_size: int = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.flatten().tolist()
        try:
            data = bytes(ids)
        except (ValueError, TypeError) as e:
            raise ValueError(f"decode needs byte token ids, integers in [0, {VOCAB_SIZE}): {e}") from None
        return data.decode("utf-8", errors="replace")


@dataclass
class Corpus:
    train: torch.Tensor  # 1-D torch.uint8 tokens
    val: torch.Tensor  # 1-D torch.uint8 tokens
    description: str
    # Names of the files in each split (relative to the source); both name the one file for a byte split.
    train_files: tuple[str, ...] = ()
    val_files: tuple[str, ...] = ()


# ----------------------------------------------------------------------------------------------------------------
# loading


def _fmt_size(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1e6:.1f} MB"
    if n >= 1_000:
        return f"{n / 1e3:.1f} kB"
    return f"{n} B"


def _files_word(n: int) -> str:
    return f"{n:,} file" if n == 1 else f"{n:,} files"


@dataclass(frozen=True)
class _Split:
    train: bytes | memoryview | _Joined | _NpyTokens  # a view of a mapped file, or files not read yet, until capped
    val: bytes | memoryview | _Joined | _NpyTokens
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    summary: str  # "N files, X MB (train ... / val ...)"


def _split_files(names: Sequence[str], blobs: Sequence[bytes | _File], val_fraction: float) -> _Split:
    if len(names) == 1:
        one = _mapped(blobs[0].path) if isinstance(blobs[0], _File) else blobs[0]
        return _split_bytes(names[0], one, val_fraction, unit="bytes")
    val_idx = _val_file_indices(names, [len(b) for b in blobs], val_fraction)
    tr = [i for i in range(len(names)) if i not in val_idx]
    va = sorted(val_idx)
    train, val = _join([blobs[i] for i in tr]), _join([blobs[i] for i in va])
    total = sum(len(b) for b in blobs)
    summary = (
        f"{_files_word(len(names))}, {_fmt_size(total)} (train {_files_word(len(tr))} {_fmt_size(len(train))}"
        f" / val {_files_word(len(va))} {_fmt_size(len(val))})"
    )
    return _Split(train, val, tuple(names[i] for i in tr), tuple(names[i] for i in va), summary)


def _split_bytes(name: str, data: bytes, val_fraction: float, unit: str) -> _Split:
    n = len(data)
    n_val = round(n * val_fraction)
    if val_fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)  # both splits non-empty
    train, val = data[: n - n_val], data[n - n_val :]
    if unit == "bytes":
        summary = (
            f"{_fmt_size(n)} (train {_fmt_size(len(train))} / val {_fmt_size(len(val))}, the last {val_fraction:.0%})"
        )
    else:
        summary = f"{n:,} tokens (train {len(train):,} / val {len(val):,}, the last {val_fraction:.0%})"
    return _Split(train, val, (name,), (name,), summary)


@functools.lru_cache(maxsize=8)
def _load_stdlib(root: str, val_fraction: float, max_bytes: int | None) -> _Split:
    # Cached: the standard library does not change while a process runs, and reading ~1,800 files costs time.
    names = stdlib_files(Path(root))
    kept, blobs, total = [], [], 0
    for name in names:
        data = (Path(root) / name).read_bytes()
        if max_bytes is not None:
            room = max_bytes - total - (len(FILE_SEPARATOR) if kept else 0)
            if len(data) > room:
                if not kept:  # the first file alone is over the cap: keep its head, never return nothing
                    kept, blobs = [name], [data[:max_bytes]]
                break
            total += len(data) + (len(FILE_SEPARATOR) if kept else 0)
        kept.append(name)
        blobs.append(data)
    return _split_files(kept, blobs, val_fraction)


class _File:
    """A file of a directory or glob source, not read yet: its size is all the split needs."""

    def __init__(self, path: Path) -> None:
        self.path, self.size = path, os.stat(path).st_size

    def __len__(self) -> int:
        return self.size


class _Joined:
    """Files joined by FILE_SEPARATOR, read only when converted to bytes and only up to `limit`: --max-bytes (a head
    slice, `_cap_user_split`) reads what it keeps, not the whole directory."""

    def __init__(self, files: Sequence[_File], limit: int | None = None) -> None:
        full = sum(f.size for f in files) + len(FILE_SEPARATOR) * max(len(files) - 1, 0)
        self.files, self.limit = list(files), full if limit is None else min(limit, full)

    def __len__(self) -> int:
        return self.limit

    def __getitem__(self, cut: slice) -> _Joined:
        if not isinstance(cut, slice) or cut.start not in (None, 0) or cut.step is not None or cut.stop is None:
            raise TypeError("a joined file list is cut only at its head: [:n]")
        return _Joined(self.files, max(cut.stop, 0))

    def __bytes__(self) -> bytes:
        out = bytearray()
        for i, f in enumerate(self.files):
            if i:
                out += FILE_SEPARATOR
            if len(out) >= self.limit:
                break
            with open(f.path, "rb") as handle:
                out += handle.read(self.limit - len(out))
        return bytes(out[: self.limit])


def _join(blobs: Sequence[bytes | _File]) -> bytes | _Joined:
    if all(isinstance(b, _File) for b in blobs) and blobs:
        return _Joined(blobs)
    return FILE_SEPARATOR.join(blobs)


def _list_directory(root: Path) -> tuple[list[str], list[_File]]:
    names, files = [], []
    for name, path in walk_files(root):
        try:
            name.encode("utf-8")  # names are hashed as UTF-8 (the split)
        except UnicodeEncodeError:
            raise ValueError(f"data file {str(path).encode('utf-8', 'surrogateescape')!r} has a name that is not "
                             "UTF-8; rename it or move it out of the directory") from None
        if _is_text(path):
            names.append(name)
            files.append(_File(path))
    return names, files


class _NpyTokens:
    """A .npy token file mapped (np.load's mmap_mode): a head slice (--max-bytes) reads only what it keeps, and the
    ids are checked to be bytes as they are read."""

    def __init__(self, arr: np.ndarray, path: Path) -> None:
        self.arr, self.path = arr, path

    def __len__(self) -> int:
        return len(self.arr)

    def __getitem__(self, cut: slice) -> _NpyTokens:
        return _NpyTokens(self.arr[cut], self.path)

    def __bytes__(self) -> bytes:
        arr = np.asarray(self.arr)
        if arr.size and (arr.min() < 0 or arr.max() >= VOCAB_SIZE):
            raise ValueError(f"{str(self.path)!r} has token ids in [{arr.min()}, {arr.max()}]; "
                             f"byte-level tokens must lie in [0, {VOCAB_SIZE})")
        return arr.astype(np.uint8).tobytes()


def _load_npy(path: Path) -> _NpyTokens:
    arr = np.load(path, allow_pickle=False, mmap_mode="r")
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{str(path)!r} holds a {arr.ndim}-D {arr.dtype} array; a .npy corpus must be 1-D integer")
    return _NpyTokens(arr, path)


def _to_tensor(data: bytes | memoryview | _Joined | _NpyTokens) -> torch.Tensor:
    # bytearray gives torch a writable buffer it owns: the cached bytes stay untouched whatever callers do.
    if not data:
        return torch.empty(0, dtype=torch.uint8, device="cpu")
    return torch.frombuffer(bytearray(bytes(data) if isinstance(data, (_Joined, _NpyTokens)) else data),
                            dtype=torch.uint8)


def load_corpus(source: str | None = None, val_fraction: float = 0.05, max_bytes: int | None = None) -> Corpus:
    """Load a byte-level corpus split into train and validation; see the module docstring for the sources."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(f"max_bytes must be None or a positive int, got {max_bytes!r}")

    if source is None or source == "stdlib":
        root = stdlib_root()
        split = _load_stdlib(str(root), float(val_fraction), max_bytes)
        desc = f"python stdlib at {root}: {split.summary}"
    else:
        split, desc = _load_user_source(source, val_fraction, max_bytes)
        _check_size(source, len(split.train) + len(split.val), max_bytes)  # sizes only: nothing read yet
        if max_bytes is not None:
            split, desc = _cap_user_split(split, desc, max_bytes)

    if max_bytes is not None and source in (None, "stdlib"):
        desc += f", capped at max_bytes={max_bytes:,}"
    if not split.train:
        raise ValueError(f"data source {source!r} gave an empty training split ({desc})")
    return Corpus(_to_tensor(split.train), _to_tensor(split.val), desc, split.train_files, split.val_files)


def _check_size(source: str, total: int, max_bytes: int | None) -> None:
    """One-line ValueError for a text source over MAX_TEXT_BYTES with no --max-bytes."""
    if max_bytes is None and total > MAX_TEXT_BYTES:
        raise ValueError(f"data source {source!r} holds {total:,} bytes, over the {MAX_TEXT_BYTES:,} a text source is "
                         "read into memory; pass --max-bytes N to train on its head, or prepare it (python -m "
                         "minidist.data prepare) to train on all of it from disk")


def _load_user_source(source: str, val_fraction: float, max_bytes: int | None = None) -> tuple[_Split, str]:
    path = Path(os.path.expanduser(source))
    if not path.exists():
        if any(c in source for c in "*?["):
            matches = glob_files(source)
            if not matches:
                raise ValueError(
                    f"data source {source!r} matches no files; pass a text file, a directory of text files, "
                    "a .bin file, or 'stdlib'"
                )
            split = _split_files(matches, [_File(Path(p)) for p in matches], val_fraction)
            return split, f"files matching {source!r}: {split.summary}"
        raise ValueError(
            f"data source {source!r} does not exist; pass a text file, a directory of text files, a .bin file, "
            "or 'stdlib'"
        )
    if not path.is_dir() and not path.is_file():  # a FIFO blocks a read forever, /dev/zero never ends
        raise ValueError(f"data source {source!r} is not a regular file or a directory (a FIFO or a device?)")
    if path.is_dir():
        names, blobs = _list_directory(path)
        if not names:
            raise ValueError(f"data source {source!r} is a directory with no text files (hidden and binary skipped)")
        split = _split_files(names, blobs, val_fraction)
        return split, f"text files under {path}: {split.summary}"
    _check_size(source, path.stat().st_size, max_bytes)  # before the file is mapped
    if path.suffix == ".bin":
        split = _split_bytes(path.name, _mapped(path), val_fraction, unit="tokens")
        return split, f"pre-tokenized uint8 file {path}: {split.summary}"
    if path.suffix == ".npy":
        split = _split_bytes(path.name, _load_npy(path), val_fraction, unit="tokens")
        return split, f"pre-tokenized .npy file {path}: {split.summary}"
    split = _split_bytes(path.name, _mapped(path), val_fraction, unit="bytes")
    return split, f"text file {path}: {split.summary}"


def _mapped(path: Path) -> memoryview | bytes:
    """The file's bytes as a view of its mapping: slices copy nothing, so --max-bytes reads only what it keeps."""
    with open(path, "rb") as f:
        return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)) if os.fstat(f.fileno()).st_size else b""


def _cap_user_split(split: _Split, desc: str, max_bytes: int) -> tuple[_Split, str]:
    # User sources are capped after the split, keeping the val share: the head of each split.
    total = len(split.train) + len(split.val)
    if total <= max_bytes:
        return split, desc + f", max_bytes={max_bytes:,} not reached"
    n_val = min(len(split.val), math.floor(max_bytes * len(split.val) / total))
    n_train = max_bytes - n_val
    capped = _Split(split.train[:n_train], split.val[:n_val], split.train_files, split.val_files, split.summary)
    return capped, desc + f", capped at max_bytes={max_bytes:,} (train {n_train:,} / val {n_val:,})"


# ----------------------------------------------------------------------------------------------------------------
# baselines


def unigram_entropy_nats(tokens: torch.Tensor) -> float:
    """H = -sum_b p(b) ln p(b) over the token frequencies: the loss of a model that knows only byte frequencies."""
    if tokens.numel() == 0:
        raise ValueError("unigram entropy needs at least one token, got an empty tensor")
    counts = torch.bincount(tokens.flatten().long()).double()
    p = counts[counts > 0] / tokens.numel()
    return float(-(p * p.log()).sum())


def unigram_entropy_bits(tokens: torch.Tensor) -> float:
    """Unigram entropy in bits per token (nats / ln 2); 8 bits is the uniform-byte ceiling."""
    return unigram_entropy_nats(tokens) / math.log(2)
