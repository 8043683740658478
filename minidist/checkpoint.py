"""Checkpoints: one directory per step, one file per rank, written atomically, found through a `latest` pointer.

    OUT/checkpoints/
        latest               text: "step_000200"
        step_000100/
            meta.json        step, world size, layout, the resolved config: written once, by rank 0
            rank0.pt         everything rank 0 needs to continue: its model shard, optimizer shard, sampler, RNG
            rank1.pt ...     (one per rank once the parallel chapters shard the state)
        step_000200/

Atomicity: a crash mid-write must never leave a directory that looks complete. Every rank writes into
`.tmp_step_XXXXXX/`; after all ranks are done (a barrier), rank 0 writes meta.json last, renames the directory to
its final name (a rename is atomic on POSIX) and then replaces `latest` (write a temporary file, `os.replace`).
A directory without meta.json, or a `.tmp_*` one, is ignored by `latest_step`.

The step in a name counts completed optimizer steps: `step_000100` holds the state after 100 updates, and a run
resumed from it continues with step index 100.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LATEST = "latest"
META = "meta.json"
FORMAT_VERSION = 1


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def save_checkpoint(root: str | os.PathLike, step: int, state: dict[str, Any], meta: dict[str, Any], *,
                    rank: int = 0, world_size: int = 1, barrier: Callable[[], None] | None = None) -> Path:
    """Write this rank's `state` for `step` under `root`; rank 0 also writes `meta` and publishes the directory.

    Collective when world_size > 1: every rank calls it with its own state, and `barrier` must synchronize them
    (e.g. `torch.distributed.barrier`). Returns the final directory.
    """
    barrier = barrier or (lambda: None)
    root = Path(root)
    final = root / step_dir_name(step)
    tmp = root / f".tmp_{step_dir_name(step)}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir(parents=True)
    barrier()
    torch.save(state, tmp / rank_file(rank))
    barrier()
    if rank == 0:
        meta = {"format": FORMAT_VERSION, "step": step, "world_size": world_size,
                "files": [rank_file(r) for r in range(world_size)], **meta}
        (tmp / META).write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():  # a checkpoint of an earlier run with the same step: replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _write_latest(root, step)
    barrier()
    return final


def _write_latest(root: Path, step: int) -> None:
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(step_dir_name(step) + "\n")
    os.replace(tmp, root / LATEST)


def latest_step(root: str | os.PathLike) -> int | None:
    """The step of the newest complete checkpoint under `root`, or None when there is none."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if (root / name / META).is_file():
            return int(name.removeprefix("step_"))
    # No usable pointer (e.g. it was lost): fall back on the complete directories themselves.
    steps = [int(p.name.removeprefix("step_")) for p in root.glob("step_*") if (p / META).is_file()]
    return max(steps, default=None)


def load_meta(root: str | os.PathLike, step: int) -> dict[str, Any]:
    return json.loads((Path(root) / step_dir_name(step) / META).read_text())


def load_checkpoint(root: str | os.PathLike, step: int, *, rank: int = 0, world_size: int = 1
                    ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state of `rank`, meta) of the checkpoint at `step`; one-line ValueError if it was written by another layout."""
    meta = load_meta(root, step)
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"checkpoint step {step} has format {meta.get('format')}, this code reads {FORMAT_VERSION}")
    if meta["world_size"] != world_size:
        raise ValueError(
            f"checkpoint step {step} was written by {meta['world_size']} rank(s), this run has {world_size}; "
            "resume with the same layout (resharding a checkpoint is not implemented)"
        )
    path = Path(root) / step_dir_name(step) / rank_file(rank)
    # weights_only=False: the state holds Python RNG state (a tuple) and numpy arrays alongside tensors.
    state = torch.load(path, map_location="cpu", weights_only=False)
    return state, meta


def remove_checkpoints(root: str | os.PathLike) -> None:
    """Delete every checkpoint under `root` (a fresh run must not leave a stale `latest` behind for --resume)."""
    root = Path(root)
    if (root / LATEST).exists() or any(root.glob("step_*")) or any(root.glob(".tmp_step_*")):
        shutil.rmtree(root)
