"""Helpers shared by the trainer-level parity tests: a run's metrics, the one-process reference run, and the
closeness rule for logged figures. Rank processes import this module too (tests/ is on their sys.path)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.debug import tolerance
from minidist.train import loop as train


def records(out: str) -> list[dict]:
    """The metrics.jsonl rows a run wrote to `out`."""
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def train_layouts(root: str, layouts: dict[str, dict], config: Callable[..., train.TrainConfig]) -> dict:
    """Rank function body: every layout {name: config changes} through `train.train` into root/<name>; per name
    this rank's losses and parameter hash, and the metrics rank 0 wrote."""
    results = {}
    for name, changes in layouts.items():
        out = str(Path(root) / name.replace(" ", "_"))
        summary = train.train(config(out, **changes))
        dist.barrier()  # rank 0 has written metrics.jsonl
        results[name] = {"losses": summary["losses"], "records": records(out), "hash": summary["param_hash"]}
    return results


def single_process_records(out: str, config: Callable[[str], train.TrainConfig]) -> list[dict]:
    """The one-process run (no process group) of `config(out)`, on one thread like each rank."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train.train(config(out))
        return records(out)
    finally:
        torch.set_num_threads(threads)


def close(got: list[float], want: list[float], steps: list[int]) -> bool:
    """Each figure within what reduction order explains after its number of steps (chapter 14's rule,
    `minidist.debug.tolerance`: 1.3e-6 relative per step in fp32). The constants it replaces (rtol 1e-5, atol
    1e-6) were looser for every run here (at most 6 steps: 8.0e-6 relative, no absolute slack)."""
    return tolerance.close(got, want, "fp32", steps)


def assert_logs_match(name: str, records: list[dict], reference: list[dict]) -> None:
    """A layout's metrics.jsonl against the one-process run's: steps, losses, gradient norms (before clipping; with
    clipping active a wrong norm also changes the later losses) and the two validation losses."""
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    steps = [r["step"] + 1 for r in reference]  # figures of step s (0-based) come after s + 1 updates or fewer
    for key in ("loss", "grad_norm"):
        got, want = [r[key] for r in records], [r[key] for r in reference]
        assert close(got, want, steps), f"{name}: {key} {got} != single process {want}"
    got = [r["val_loss"] for r in records if "val_loss" in r]
    want = [r["val_loss"] for r in reference if "val_loss" in r]
    val_steps = [r["step"] + 1 for r in reference if "val_loss" in r]
    assert len(want) == 2 and close(got, want, val_steps), f"{name}: val_loss {got} != single process {want}"
