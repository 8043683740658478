"""--tensorboard: the figures of metrics.jsonl as TensorBoard event files in OUT/tensorboard/.

The trainer reads its figures on the host once per logging window (`loop.read_window`); this module writes those
same records, already floats, so TensorBoard costs no host read of its own. Rank 0 writes them all: every figure
of a record is global (the loss of the global batch, the clipped norm, the step's time) except the peak memory,
which the loop already gathers from every rank, and which is written as one curve per rank (`memory/peak_bytes/rankR`).

A resumed run appends a new event file to the same directory, starting with a purge at its first step: TensorBoard
then drops the steps the interrupted run wrote after its checkpoint, so every step appears once, as in
metrics.jsonl (`metrics.start_metrics`). `tensorboard` is an optional extra: without it, `require_tensorboard`
refuses the flag in one line before any process group starts.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any

from minidist import out_files
from minidist.train.settings import RankConfigError

INSTALL = "pip install -e '.[tensorboard]'"
DIRECTORY = "tensorboard"

# metrics.jsonl's name -> TensorBoard's tag: grouped into sections of the dashboard
TAGS = {"loss": "train/loss", "val_loss": "train/val_loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
        "aux_loss": "train/aux_loss", "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu", "step_s": "perf/step_s",
        "peak_mem_bytes": "memory/peak_bytes"}


def require_tensorboard() -> None:
    """ValueError (one line) if the `tensorboard` package torch's SummaryWriter needs is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401  (it imports tensorboard itself)
    except ImportError as e:
        raise ValueError(f"--tensorboard needs the tensorboard package ({e}); install it with {INSTALL}, "
                         "or run without --tensorboard") from None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics.jsonl record as {tag: value}: numbers as they are, a list per index (one value per rank), a table
    per key (the FP8 SNR per layer); `step` is the event's step, not a scalar."""
    out: dict[str, float] = {}

    def add(tag: str, value: Any) -> None:
        if isinstance(value, bool):
            return
        if isinstance(value, int | float):
            if math.isfinite(value):
                out[tag] = float(value)
        elif isinstance(value, list | tuple):
            suffix = "rank" if tag == TAGS["peak_mem_bytes"] else ""
            for i, item in enumerate(value):
                add(f"{tag}/{suffix}{i}", item)
        elif isinstance(value, dict):
            for key, item in value.items():
                add(f"{tag}/{key}", item)

    for name, value in record.items():
        if name != "step":
            section = f"moe/{name.removeprefix('moe_')}" if name.startswith("moe_") else f"other/{name}"
            add(TAGS.get(name, section), value)
    return out


class Dashboard:
    """TensorBoard's writer for one run on rank 0: `write` a window's records, `close` at the end."""

    def __init__(self, out: Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.fd = open_own_directory(Path(out) / DIRECTORY)
        # Written through the descriptor of the directory checked here (Linux's /proc/self/fd): a link planted at
        # OUT/tensorboard later is never followed. purge_step: TensorBoard forgets any earlier file's events from
        # start_step on (a resumed run's redone steps).
        where = f"/proc/self/fd/{self.fd}" if os.path.isdir("/proc/self/fd") else str(Path(out) / DIRECTORY)
        self.writer = SummaryWriter(log_dir=where, purge_step=start_step)

    def write(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            for tag, value in scalars(record).items():
                self.writer.add_scalar(tag, value, global_step=record["step"])
        self.writer.flush()  # on logging steps only: a run that stops later loses none of it

    def close(self) -> None:
        self.writer.close()
        os.close(self.fd)


def open_own_directory(path: Path) -> int:
    """A descriptor of the directory `path` (created if missing); RankConfigError (one line) if it is a symbolic
    link or not a directory: the trainer writes nothing through a link."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path)
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | out_files.NO_FOLLOW)
    except OSError:
        raise RankConfigError(f"{path} is a symbolic link or not a directory; the trainer writes nothing through a "
                              "link (remove it, or give another --out)") from None
