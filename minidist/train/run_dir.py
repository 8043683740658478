"""The output directory OUT: a run is never destroyed by accident.

OUT holds a run when it has any of `checkpoints/`, `metrics.jsonl` or `run.json`. A new run into such an OUT is
refused (one line) unless it says what to do with the old one: `--resume` continues it, `--overwrite` replaces it.
`--overwrite` removes the trainer's own files only (RUN_FILES); anything else in OUT (notes, data, other
programs' outputs) stays. `check_out` runs on every rank before anything is built; `prepare_out` then waits for
all ranks (so none checks an OUT that rank 0 is already changing) and, on rank 0, clears and creates OUT.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from minidist.train import checkpoint
from minidist.train.config import ConfigError, TrainConfig

RUN_MARKERS = ("checkpoints", "metrics.jsonl", "run.json")  # any of these: OUT holds a run
RUN_FILES = (*RUN_MARKERS, "loss.png", "flight")  # what the trainer writes, and all that --overwrite removes


def check_out(cfg: TrainConfig) -> None:
    """One-line ConfigError if OUT cannot be written, or holds a run that this one would destroy."""
    out = Path(cfg.out).expanduser()
    existing = next(p for p in (out, *out.parents) if p.exists())  # OUT, or the directory it would be made in
    if not existing.is_dir():
        where = "is a file" if existing == out else f"cannot be created: {existing} is a file"
        raise ConfigError(f"--out {cfg.out} {where}; give a directory")
    if not _can_write(existing):
        raise ConfigError(f"--out {cfg.out}: cannot write in {existing} (permission or read-only filesystem)")
    found = [name for name in RUN_MARKERS if os.path.lexists(out / name)]
    if found and not (cfg.resume or cfg.overwrite):
        raise ConfigError(f"--out {cfg.out} already holds a run ({', '.join(found)}); continue it with --resume "
                          "or replace it with --overwrite")
    if found and cfg.resume:
        try:
            step = checkpoint.latest_step(out / "checkpoints")
        except ValueError as e:
            raise ConfigError(f"cannot resume: {e}") from None
        if step is None:  # starting at step 0 would replace the run's metrics
            raise ConfigError(f"--resume: {out / 'checkpoints'} holds no checkpoint, but OUT holds a run "
                              f"({', '.join(found)}); start it again with --overwrite instead of --resume")


def _can_write(directory: Path) -> bool:
    """Try it: permission bits do not tell about read-only mounts, and root passes every bit check."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def prepare_out(out: Path, *, overwrite: bool, is_main: bool, barrier: Callable[[], None] | None = None) -> None:
    """After every rank's `check_out` (the barrier), rank 0 removes the old run if `overwrite`, then creates OUT."""
    if barrier is not None:
        barrier()
    if not is_main:
        return
    if overwrite:
        clear_run(out)
    out.mkdir(parents=True, exist_ok=True)


def clear_run(out: Path) -> list[str]:
    """Remove the trainer's files from OUT (nothing else); return the names removed. A symlink is unlinked, never
    followed: what it points to is not the trainer's."""
    removed = []
    for name in RUN_FILES:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed
