"""The documents of a text source, listed without reading them, and cut into pieces for parallel tokenizing.

Sources are the trainer's text sources (`minidist.data.corpus`): ``stdlib``, a directory (every regular file
below it except hidden and binary ones), a glob pattern, a text file. A document is a file. A single file is split
like today's byte corpus: validation is its last `val_fraction` of the bytes, so it makes two documents, one per
split. A document bigger than `PIECE_BYTES` is tokenized in pieces cut after a newline that a non-space byte
follows (a boundary a byte-level BPE's pre-tokenizer splits at anyway, so the ids are those of the whole text);
without one within a piece's length, before a space, else before a character's first byte (a piece is never over
2 x PIECE_BYTES: a 40 GB file of one line is tokenized piece by piece too); the end-of-document token closes its
last piece only. `max_bytes` stops the listing once the documents hold that many
bytes (the last one cut), before the split. The standard library's file list and the split rule (files in the order
of a hash of their names) live here and `corpus.py` uses them, so `prepare` splits as the trainer's text sources do,
and imports no torch.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import stat
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PIECE_BYTES = 4 * 2**20
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
_BINARY_SNIFF_BYTES = 8192
_LINE_START = re.compile(rb"\n[^ \t\r\n\x0b\x0c]")  # a newline, then a non-space byte
_CHAR_START = re.compile(rb"[\x00-\xff][^\x80-\xbf]")  # then a byte that starts a UTF-8 character


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the standard-library ``.py`` files in the default corpus, sorted."""
    root = stdlib_root() if root is None else root
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _skip_stdlib_dir(d)]
        rel_dir = Path(dirpath).relative_to(root)
        for name in filenames:
            if name.endswith(".py") and not name.startswith((".", "_sysconfigdata")):
                found.append((rel_dir / name).as_posix())
    return sorted(found)


def _skip_stdlib_dir(name: str) -> bool:
    return name in _STDLIB_SKIP_DIRS or name.startswith((".", "config-"))


def _path_hash(name: str) -> int:
    # A stable hash (Python's hash() is salted per process).
    return int.from_bytes(hashlib.blake2b(os.fsencode(name), digest_size=8).digest(), "big")  # any file name


def _val_file_indices(names: Sequence[str], sizes: Sequence[int], val_fraction: float) -> set[int]:
    """Files in hash order until validation holds >= val_fraction of the bytes; never all files."""
    if val_fraction == 0 or len(names) < 2:
        return set()
    order = sorted(range(len(names)), key=lambda i: (_path_hash(names[i]), names[i]))
    target = val_fraction * sum(sizes)
    chosen: set[int] = set()
    held = 0
    for i in order[:-1]:
        if held >= target:
            break
        chosen.add(i)
        held += sizes[i]
    return chosen


@dataclass(frozen=True)
class Piece:
    """Bytes [start, end) of a file; `last`: the end of its document (the EOD token follows)."""

    path: str
    start: int
    end: int
    last: bool


@dataclass(frozen=True)
class Listing:
    train: list[Piece]
    val: list[Piece]
    train_docs: int
    val_docs: int
    description: str


def _regular_size(path: Path, source: str) -> int:
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):  # a FIFO blocks a read forever, /dev/zero never ends
        raise ValueError(f"data source {source!r}: {str(path)!r} is not a regular file (a FIFO or a device?)")
    return st.st_size


def walk_files(root: Path) -> list[tuple[str, Path]]:
    """(relative POSIX name, path) of the regular files below `root`, sorted by name; hidden files and directories
    skipped (a directory source's files, binary ones still in: `_is_text`)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath) / name
            if not name.startswith(".") and path.is_file():
                found.append((path.relative_to(root).as_posix(), path))
    return sorted(found)


def glob_files(pattern: str) -> list[str]:
    """The regular files a glob source matches (``**`` recursive, ``~`` expanded), sorted."""
    return sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if Path(p).is_file())


def _is_text(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" not in f.read(_BINARY_SNIFF_BYTES)


def list_files(source: str) -> tuple[list[tuple[str, Path]], str]:
    """(name, path) of each document of `source` in a fixed order, and a description of the source."""
    if source in ("stdlib", ""):
        root = stdlib_root()
        return [(n, root / n) for n in stdlib_files(root)], f"python stdlib at {root}"
    path = Path(os.path.expanduser(source))
    if not path.exists() and any(c in source for c in "*?["):
        found = glob_files(source)
        if not found:
            raise ValueError(f"data source {source!r} matches no files")
        return [(p, Path(p)) for p in found], f"files matching {source!r}"
    if not path.exists():
        raise ValueError(f"data source {source!r} does not exist; pass a text file, a directory, a glob or 'stdlib'")
    if path.is_dir():
        files = [(name, p) for name, p in walk_files(path) if _is_text(p)]
        if not files:
            raise ValueError(f"data source {source!r} is a directory with no text files (hidden and binary skipped)")
        return files, f"text files under {path}"
    _regular_size(path, source)
    if path.suffix in (".bin", ".npy"):
        raise ValueError(f"data source {source!r} holds tokens already; prepare takes text (train on it with --data)")
    return [(path.name, path)], f"text file {path}"


def read_range(path: str | Path, start: int, end: int) -> bytes:
    """Bytes [start, end) of a file (a piece's), read alone."""
    with open(path, "rb") as f:
        f.seek(start)
        return f.read(end - start)


def _pieces(path: Path, start: int, end: int) -> list[Piece]:
    """[start, end) of `path` cut after a newline followed by a non-space byte, about every PIECE_BYTES."""
    cuts = [start]
    with open(path, "rb") as f:
        while end - cuts[-1] > PIECE_BYTES:
            f.seek(cuts[-1] + PIECE_BYTES)
            window = f.read(min(PIECE_BYTES, end - cuts[-1] - PIECE_BYTES))
            cut = _cut(window)
            if cut is None:  # the window ends the source
                break
            cuts.append(cuts[-1] + PIECE_BYTES + cut)
    bounds = cuts + [end]
    return [Piece(str(path), a, b, last=b == end) for a, b in zip(bounds[:-1], bounds[1:])]


def _cut(window: bytes) -> int | None:
    """Where to cut in `window`: after a newline a non-space byte follows, else before a space, else before a
    character's first byte (no piece over 2 x PIECE_BYTES, whatever the text: a file of one line would otherwise
    be read and tokenized whole); None for a window too short to cut."""
    found = b"\n" in window and _LINE_START.search(window)
    if found:
        return found.start() + 1
    space = window.find(b" ", 1)  # before it: a byte-level BPE's words carry their leading space
    if space > 0:
        return space
    found = _CHAR_START.search(window)
    return found.start() + 1 if found else None


def list_pieces(source: str, val_fraction: float, max_bytes: int | None = None,
                exclude: Path | None = None) -> Listing:
    """The pieces of each split in order (module docstring); one-line ValueError for a bad source. Files under
    `exclude` (the dataset being written, when it lies inside the source) are no documents."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    files, desc = list_files(source)
    if exclude is not None:
        files = [(n, p) for n, p in files if not p.resolve().is_relative_to(exclude.resolve())]
        if not files:
            raise ValueError(f"data source {source!r} holds no documents outside --out {str(exclude)!r}")
    names, paths, sizes, total = [], [], [], 0
    for name, path in files:
        size = _regular_size(path, source)
        if max_bytes is not None:
            size = min(size, max_bytes - total)
        names.append(name)
        paths.append(path)
        sizes.append(size)
        total += size
        if max_bytes is not None and total >= max_bytes:
            desc += f", capped at max_bytes={max_bytes:,}"
            break
    if total == 0:
        raise ValueError(f"data source {source!r} holds no text (its {len(names)} file(s) are empty)")
    if len(names) == 1:
        n = sizes[0]
        n_val = min(max(round(n * val_fraction), 1), n - 1) if val_fraction > 0 and n >= 2 else 0
        train = _pieces(paths[0], 0, n - n_val)
        val = _pieces(paths[0], n - n_val, n) if n_val else []
        return Listing(train, val, 1, int(bool(n_val)), desc)
    val_idx = _val_file_indices(names, sizes, val_fraction)
    train = [p for i in range(len(names)) if i not in val_idx and sizes[i] for p in _pieces(paths[i], 0, sizes[i])]
    val = [p for i in sorted(val_idx) if sizes[i] for p in _pieces(paths[i], 0, sizes[i])]
    if not train:
        raise ValueError(f"data source {source!r}: every non-empty file went to validation; lower --val-fraction")
    return Listing(train, val, sum(p.last for p in train), sum(p.last for p in val), desc)
