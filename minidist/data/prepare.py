"""`python -m minidist.data prepare SOURCE --tokenizer T --out DATA_DIR`: a text source tokenized into a dataset.

The dataset (`minidist.data.dataset` reads it): ``manifest.json`` (format "minidist-tokens", version 1: dtype,
vocabulary size, end-of-document id, the tokenizer file and its SHA-256, the source, and per split its tokens, its
document index and its shards, each with its SHA-256), ``tokenizer.json`` (for ``bytes`` too), raw little-endian
shards ``train_00000.bin``, ... (uint16 when the vocabulary fits, else uint32) of `shard_tokens` tokens each (the
last shorter), and the document index ``train_docs.bin``: int64, the end offset of each document in the split's
stream, its EOD token included. Documents, pieces and the split: `minidist.data.documents`.

Determinism: pieces are tokenized in worker processes (`workers`, spawned) but collected in input order, so the
shards, the index and the manifest are the same bytes whatever the number of workers (tests/test_prepare.py). The
manifest is written last: a directory without one is no dataset (an interrupted prepare leaves none). Called from a
script with workers > 1, call it under ``if __name__ == "__main__":`` (spawned workers import the main module).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from minidist import out_files
from minidist.data import tokenizer as tokenizers
from minidist.data.documents import Listing, Piece, list_pieces, read_range

FORMAT, VERSION = "minidist-tokens", 1
DEFAULT_SHARD_TOKENS = 2**27  # 256 MB of uint16 per shard
LOCK = ".lock"  # held by the prepare writing the directory (`out_files.locked`, as the trainer holds its OUT)
DATASET_FILE = re.compile(r"(train|val)_(\d{5}|docs)\.bin|manifest\.json|tokenizer\.json")


class _SplitWriter:
    """One split's shards, document index and token counts, written as the ids arrive (in order)."""

    def __init__(self, out: Path, split: str, tok: tokenizers.TextTokenizer, shard_tokens: int) -> None:
        self.out, self.split, self.dtype, self.shard_tokens = out, split, tok.dtype, shard_tokens
        self.eod = np.asarray([tok.eod_id], dtype=tok.dtype)
        self.counts = np.zeros(tok.vocab_size, dtype=np.int64)
        self.shards: list[dict] = []
        self.ends: list[int] = []
        self.total = 0
        self._file, self._hash, self._held = None, None, 0

    def add(self, ids: np.ndarray, last: bool) -> None:
        if len(ids) and int(ids.max()) >= len(self.counts):  # before the count table or a shard could take it
            raise ValueError(f"the tokenizer produced id {int(ids.max()):,}, outside its vocabulary of "
                             f"{len(self.counts):,}; the dataset would not fit the model")
        ids = np.concatenate([ids, self.eod]) if last else ids
        self.counts += np.bincount(ids, minlength=len(self.counts))
        while len(ids):
            if self._file is None:
                self._file, self._hash, self._held = _new_file(self._path(len(self.shards))), hashlib.sha256(), 0
            take = ids[: self.shard_tokens - self._held]
            data = take.astype(self.dtype.newbyteorder("<"), copy=False).tobytes()
            self._file.write(data)
            self._hash.update(data)
            self._held += len(take)
            self.total += len(take)
            ids = ids[len(take):]
            if self._held == self.shard_tokens:
                self._close_shard()
        if last:
            self.ends.append(self.total)

    def _path(self, i: int) -> Path:
        return self.out / f"{self.split}_{i:05d}.bin"

    def _close_shard(self) -> None:
        self._file.close()
        self.shards.append({"file": self._path(len(self.shards)).name, "tokens": self._held,
                            "sha256": self._hash.hexdigest()})
        self._file = None

    def finish(self) -> dict:
        if self._file is not None:
            self._close_shard()
        index = np.asarray(self.ends, dtype="<i8").tobytes()
        out_files.replace_file(self.out / f"{self.split}_docs.bin", index)
        return {"tokens": self.total, "shards": self.shards, "unigram_entropy_nats": _entropy(self.counts),
                "documents": {"file": f"{self.split}_docs.bin", "count": len(self.ends),
                              "sha256": hashlib.sha256(index).hexdigest()}}


def _new_file(path: Path) -> BinaryIO:
    """`path` opened for writing as a new file: a name that appeared since --out was checked (a planted link) is
    refused in one line, never written through."""
    try:
        return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | out_files.NO_FOLLOW, 0o644), "wb")
    except FileExistsError:
        raise ValueError(f"{path} appeared while prepare was writing (another process, or a link?); nothing was "
                         "written through it") from None


def _entropy(counts: np.ndarray) -> float:
    total = counts.sum()
    if total == 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum())


def check_out(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty OUT; with `overwrite`, remove a previous dataset's files there and nothing else."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a directory")
    entries = sorted(p.name for p in out.iterdir() if p.name != LOCK) if out.exists() else []
    if entries and not overwrite:
        raise ValueError(f"--out {str(out)!r} is not empty ({len(entries)} entries); pass --overwrite to replace a "
                         "dataset there, or choose an empty directory")
    foreign = [e for e in entries if not DATASET_FILE.fullmatch(e)]
    if foreign:
        raise ValueError(f"--out {str(out)!r} holds files that are no dataset's ({', '.join(foreign[:3])}); "
                         "--overwrite replaces a dataset only: choose an empty directory")
    for name in entries:
        (out / name).unlink()
    out.mkdir(parents=True, exist_ok=True)


def _texts(pieces: Iterable[Piece]) -> Iterator[str]:
    for p in pieces:
        yield read_range(p.path, p.start, p.end).decode("utf-8", errors="replace")


def _encoded(pieces: list[Piece], tok: tokenizers.TextTokenizer, workers: int) -> Iterator[np.ndarray]:
    """The ids of each piece, in order: in this process (workers=1) or in `workers` spawned processes."""
    jobs = [(p.path, p.start, p.end) for p in pieces]
    if workers == 1:
        tokenizers.worker_init(tok)
        yield from map(tokenizers.worker_encode, jobs)
        return
    with multiprocessing.get_context("spawn").Pool(workers, tokenizers.worker_init, (tok,)) as pool:
        yield from pool.imap(tokenizers.worker_encode, jobs, chunksize=1)


class _Progress:
    """One line on stderr, redrawn at most twice a second: bytes done of the total, tokens, throughput."""

    def __init__(self, total_bytes: int, enabled: bool) -> None:
        self.total, self.enabled, self.done, self.tokens = total_bytes, enabled, 0, 0
        self.start = self.last = time.perf_counter()

    def update(self, nbytes: int, ntokens: int, final: bool = False) -> None:
        self.done, self.tokens = self.done + nbytes, self.tokens + ntokens
        now = time.perf_counter()
        if self.enabled and (final or now - self.last > 0.5):
            self.last, rate = now, self.done / max(now - self.start, 1e-9)
            share = self.done / max(self.total, 1)
            print(f"\rprepare: {self.done / 1e6:,.1f}/{self.total / 1e6:,.1f} MB ({share:.0%}), "
                  f"{self.tokens:,} tokens, {rate / 1e6:,.1f} MB/s",
                  end="\n" if final else "", file=sys.stderr, flush=True)


def prepare(source: str, tokenizer: str = "bytes", out: str | Path = "data", *, workers: int = 1,
            val_fraction: float = 0.05, max_bytes: int | None = None, overwrite: bool = False,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, eod_token: str | None = None, progress: bool = True) -> dict:
    """Tokenize `source` into the dataset directory `out` (module docstring); return its manifest."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers must be an int >= 1, got {workers!r}")
    if shard_tokens < 1 or (max_bytes is not None and max_bytes < 1):
        raise ValueError(f"shard_tokens and max_bytes must be >= 1, got {shard_tokens} and {max_bytes}")
    out = Path(out)
    listing = list_pieces(source, val_fraction, max_bytes, exclude=out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} exists and is not a directory")
    out_files.refuse_link(out)
    with out_files.locked(out, LOCK, log=lambda line: print(line, file=sys.stderr)):  # one prepare per --out
        check_out(out, overwrite)
        tok = tokenizers.resolve_tokenizer(tokenizer, _texts(listing.train), eod_token)
        out_files.replace_file(out / "tokenizer.json", tok.json.encode("utf-8"))
        splits = _write_splits(out, listing, tok, workers, shard_tokens, progress)
        manifest = {"format": FORMAT, "version": VERSION, "dtype": tok.dtype.name, "vocab_size": tok.vocab_size,
                    "eod_id": tok.eod_id, "tokenizer": {"file": "tokenizer.json", "spec": tok.spec,
                                                        "sha256": hashlib.sha256(tok.json.encode()).hexdigest()},
                    "source": listing.description, "splits": splits}
        out_files.replace_file(out / "manifest.json", (json.dumps(manifest, indent=1) + "\n").encode("utf-8"))
    return manifest


def _write_splits(out: Path, listing: Listing, tok: tokenizers.TextTokenizer, workers: int, shard_tokens: int,
                  progress: bool) -> dict:
    pieces = listing.train + listing.val
    meter = _Progress(sum(p.end - p.start for p in pieces), progress)
    writers = {"train": _SplitWriter(out, "train", tok, shard_tokens), "val": _SplitWriter(out, "val", tok,
                                                                                           shard_tokens)}
    for i, ids in enumerate(_encoded(pieces, tok, workers)):
        piece = pieces[i]
        writers["train" if i < len(listing.train) else "val"].add(ids, piece.last)
        meter.update(piece.end - piece.start, len(ids))
    meter.update(0, 0, final=True)
    return {name: w.finish() for name, w in writers.items()}

