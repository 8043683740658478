"""Checkpoints: one directory per step, one file per rank, written durably, checked when read back.

    OUT/checkpoints/
        latest               text: "step_000200"
        step_000100/
            meta.json        step, world size, layout, the resolved config, each rank file's size and SHA-256,
                             the index of every piece (which file holds which elements of which tensor)
            rank0.pt         rank 0's pieces, its random generators, and the run state (schedule, sampler, ...)
            rank1.pt ...     one per rank: its pieces (none for a replica) and its random generators
        step_000200/

What the files hold is the caller's (minidist.train.run_state); the trainer writes each element of the model and of its
optimizer state once, in the file of its first holder (minidist.train.reshard): a dp replica's file holds only its
random generators.

Atomicity: a crash mid-write must never leave a directory that looks complete. Every rank writes into
`.tmp_step_XXXXXX/` its state file and a small `rankR.sha256` note (the file's size and digest, computed where it
was written). After all ranks are done (a barrier), rank 0 folds the notes into meta.json, writes it last, renames
the directory to its final name (a rename is atomic on POSIX) and then replaces `latest` (write a temporary file,
`os.replace`). Each file, and each directory whose entries changed, is fsync'ed before the rename that publishes
it: without that, a power cut can leave a renamed directory whose files are still empty.
A directory without meta.json, or a `.tmp_*` one, is ignored by `latest_step`.

Trust: a checkpoint may come from anywhere. Loading never unpickles code: rank files are read with
`torch.load(weights_only=True)` (tensors and plain containers, numbers and strings only), meta.json as JSON and
`latest` as a name. A file whose size or SHA-256 differs from meta.json (truncated, bit-flipped) or that is missing
is refused with one line naming it.

The step in a name counts completed optimizer steps: `step_000100` holds the state after 100 updates, and a run
resumed from it continues with step index 100.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minidist import out_files

LATEST = "latest"
META = "meta.json"
# 2: meta.json records each rank file's size and SHA-256; 3: rank files hold pieces only; 4: meta.json carries the
# SHA-256 of its own contents (the index of pieces decides what is loaded: a flipped bit there loads the wrong tensor)
FORMAT_VERSION = 4
META_SHA = "meta_sha256"
META_MAX_BYTES = 256 << 20  # far above any index (15-25 kB for the tiny model in any layout); a bound on hostile input
STEP_NAME = re.compile(r"step_(\d{6,})")
PLAIN = (str, int, float, bool, type(None), torch.Tensor)  # what weights_only=True reads back, with dict/list/tuple


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def save_checkpoint(root: str | os.PathLike, step: int, state: dict[str, Any], meta: dict[str, Any], *,
                    rank: int = 0, world_size: int = 1, barrier: Callable[[], None] | None = None,
                    pieces: list[dict] | None = None) -> Path:
    """Write this rank's `state` for `step` under `root`; rank 0 also writes `meta` and publishes the directory.

    Collective when world_size > 1: every rank calls it with its own state, and `barrier` must synchronize them
    (e.g. `torch.distributed.barrier`). Returns the final directory. `pieces`: this rank's entries of the index
    that lets another layout read the checkpoint (minidist.train.reshard); meta.json lists them with their file.
    """
    check_plain(state)  # fail at save time, not at the resume that needs it
    barrier = barrier or (lambda: None)
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".tmp_{step_dir_name(step)}"
    if rank == 0:
        for path in (root, final):  # a received run's links: nothing outside OUT is written or deleted
            out_files.refuse_link(path)
        if tmp.is_symlink():
            tmp.unlink()
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir(parents=True)
    barrier()
    path = tmp / rank_file(rank)
    try:
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | out_files.NO_FOLLOW, 0o644), "wb") as f:
            torch.save(state, f)
            _flush_to_disk(f)
    except (OSError, RuntimeError) as e:  # a full disk: torch says "unexpected pos"; `latest` still names the last
        first = (getattr(e, "strerror", None) or str(e)).splitlines() or [type(e).__name__]
        raise OSError(f"cannot write the checkpoint file {path}: {first[0]} (a full disk?); the previous "
                      "checkpoint is intact") from None
    note = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}  # hashed where it was written
    if pieces is not None:
        note["pieces"] = pieces
    _write_durably(tmp / f"rank{rank}.sha256", json.dumps(note).encode())
    barrier()
    if rank == 0:
        files, index = {}, []
        for r in range(world_size):
            note = json.loads((tmp / f"rank{r}.sha256").read_text())
            index += [{**entry, "file": rank_file(r)} for entry in note.pop("pieces", [])]
            files[rank_file(r)] = note
            (tmp / f"rank{r}.sha256").unlink()  # meta.json holds them now
        meta = {"format": FORMAT_VERSION, "step": step, "world_size": world_size, "files": files, **meta}
        if pieces is not None:
            meta["pieces"] = index
        _write_durably(tmp / META, (json.dumps(seal_meta(meta), indent=2) + "\n").encode())
        _fsync_dir(tmp)
        if final.exists():  # a checkpoint of the same run at the same step (a resumed run redid it): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
        _write_latest(root, step)
    barrier()
    return final


def meta_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of meta.json's contents without its own digest, in one canonical JSON form (whitespace and key order
    do not count; every value does)."""
    body = {k: v for k, v in meta.items() if k != META_SHA}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def seal_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with its digest (`meta_digest`) under META_SHA: what save_checkpoint writes."""
    return {**meta, META_SHA: meta_digest(meta)}


def check_plain(value: Any, where: str = "state") -> None:
    """Raise TypeError unless `value` is tensors, numbers and strings in dicts, lists and tuples: what
    `torch.load(weights_only=True)` reads back. Convert anything else (numpy arrays, objects) to those first."""
    if isinstance(value, dict):
        for key, item in value.items():
            check_plain(key, f"a key of {where}")
            check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, PLAIN):
        raise TypeError(f"{where} is a {type(value).__name__}; a checkpoint holds only tensors and plain data")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _flush_to_disk(f: Any) -> None:
    f.flush()
    os.fsync(f.fileno())


def _write_durably(path: Path, data: bytes) -> None:
    """Write and fsync `path`; a link there is an error (ELOOP), never followed."""
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | out_files.NO_FOLLOW, 0o644), "wb") as f:
        f.write(data)
        _flush_to_disk(f)


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (files created, renamed or removed in it) survive a power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_latest(root: Path, step: int) -> None:
    # a fresh temporary file and a rename: a link at `latest` is replaced, not written through
    out_files.replace_file(root / LATEST, (step_dir_name(step) + "\n").encode(), sync=True)
    _fsync_dir(root)


def latest_step(root: str | os.PathLike) -> int | None:
    """The step of the newest complete checkpoint under `root`, or None when there is none.
    A `latest` that does not hold a step directory's name is a one-line ValueError naming it."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file() and not pointer.is_symlink():  # a link may point at anything (/dev/zero)
        name = pointer.read_bytes().strip()
        match = STEP_NAME.fullmatch(name.decode("ascii", errors="replace"))
        if match is None:
            raise ValueError(f"{pointer} does not hold a checkpoint name like step_000100")
        if int(match.group(1)) in complete_steps(root):
            return int(match.group(1))
    # No usable pointer (e.g. it was lost): fall back on the complete directories themselves.
    return max(complete_steps(root), default=None)


def complete_steps(root: Path) -> list[int]:
    """Steps of the published checkpoint directories under `root` (those with a meta.json), in order. A link is
    no checkpoint of this run's: it is neither read nor pruned."""
    matches = [STEP_NAME.fullmatch(p.name) for p in root.glob("step_*") if not p.is_symlink()]
    return sorted(int(m.group(1)) for m in matches if m and (root / m.group(0) / META).is_file())


def load_meta(root: str | os.PathLike, step: int) -> dict[str, Any]:
    """meta.json of the checkpoint at `step`, read as JSON and checked; one-line ValueError naming it otherwise."""
    path = Path(root) / step_dir_name(step) / META
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size > META_MAX_BYTES:  # a FIFO, a link
            raise ValueError(f"{path} is not a regular file of at most {META_MAX_BYTES >> 20} MiB")
        meta = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:  # missing, not UTF-8, not JSON, nested too deep
        raise ValueError(f"{path} is not readable JSON ({type(e).__name__})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{path} has format {found!r}, this code reads {FORMAT_VERSION} only; resume it with "
                         "the minidist version that wrote it")
    if meta.get(META_SHA) != meta_digest(meta):  # before anything in it is used
        raise ValueError(f"{path} does not match its own SHA-256 ({META_SHA}): corrupted or altered")
    world_size, files = meta.get("world_size"), meta.get("files")
    if type(world_size) is not int or not isinstance(files, dict) or len(files) != world_size or sorted(
            files) != sorted(rank_file(r) for r in range(world_size)):  # the length first: no 10^9 names built
        raise ValueError(f"{path} does not list one file per rank")
    return meta


def read_rank_file(path: Path, recorded: Any, *, mmap: bool = False) -> Any:
    """A rank file's contents, checked first against the size and SHA-256 meta.json `recorded` (`verify_file`).
    `mmap`: map the file instead of reading it, so only the bytes used are read (minidist.train.reshard)."""
    verify_file(path, recorded)
    try:
        # weights_only: the unpickler builds tensors and plain containers only, never an arbitrary object.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # noqa: BLE001 - whatever a hostile file makes torch raise becomes one line
        raise ValueError(f"{path} was refused: it holds more than tensors and plain data "
                         f"({type(e).__name__})") from None


def verify_file(path: Path, recorded: Any) -> None:
    """One-line ValueError unless `path` exists with the size and SHA-256 that meta.json recorded."""
    if not isinstance(recorded, dict) or not {"bytes", "sha256"} <= set(recorded):
        raise ValueError(f"{path.parent / META} records no size and SHA-256 for {path.name}")
    if not path.is_file():
        raise ValueError(f"{path} is missing")
    size = path.stat().st_size
    if size != recorded["bytes"]:
        raise ValueError(f"{path} has {size} bytes, meta.json records {recorded['bytes']} (truncated or replaced)")
    if sha256_file(path) != recorded["sha256"]:
        raise ValueError(f"{path} does not match the SHA-256 in meta.json (corrupted or altered)")


def prune_checkpoints(root: str | os.PathLike, keep: int) -> list[int]:
    """Delete all but the `keep` newest complete checkpoints, never the one `latest` names; return the steps
    deleted. Only published `step_*` directories are touched."""
    root = Path(root)
    steps = complete_steps(root)
    protected = latest_step(root)
    doomed = [s for s in steps[:-keep] if s != protected]
    for step in doomed:
        shutil.rmtree(root / step_dir_name(step))
    return doomed
