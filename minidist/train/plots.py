"""Plots of a run, drawn from its metrics.jsonl.

Figures are built with `matplotlib.figure.Figure` directly, not pyplot: no global figure state and no GUI backend,
so the trainer can save a PNG from any process, and a notebook that imports this keeps its own backend.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from matplotlib.figure import Figure

from minidist.out_files import replace_file


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """The records of a metrics.jsonl file, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(records: list[dict], path: str | os.PathLike, baseline: float | None = None,
                title: str = "") -> Path:
    """Training loss per step and validation loss where measured; `baseline` (e.g. unigram entropy) as a line."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["loss"] for r in records], lw=1, label="train")
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if val:
        ax.plot(*zip(*val), "o-", ms=4, label="validation")
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", lw=1, label=f"unigram entropy {baseline:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    path = Path(path)  # a link at `path` is replaced, never written through (minidist.out_files)
    return replace_file(path, lambda f: fig.savefig(f, dpi=110, format=path.suffix[1:] or "png"))
