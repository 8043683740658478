"""What a run writes and prints: run.json (the settings and the numbers every figure is measured against),
metrics.jsonl (one object per optimizer step) and the progress lines on rank 0.

Every row records each rank's peak memory so far (`peak_memory_bytes`), measured once per logging window, at the
step that reads it: on CUDA `torch.cuda.max_memory_allocated` (the caching allocator's count of live tensor bytes at
their peak). A CPU has no such counter, so the documented
substitute is the process's peak resident set size (`getrusage(RUSAGE_SELF).ru_maxrss`): it also counts the
interpreter, the libraries and freed-but-cached pages, so it is an upper bound of the tensor bytes, never below them.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

from minidist import out_files
from minidist.comm.communicator import Comm


class MetricsWriter:
    """Appends one JSON object per optimizer step to metrics.jsonl, flushed at once: the trainer writes a logging
    window's records together when it reads them (at every logging step, evaluation, check, checkpoint, the end)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        self.write_many([record])

    def write_many(self, records: list[dict[str, Any]]) -> None:
        out_files.append_text(self.path, "".join(json.dumps(jsonable(record)) + "\n" for record in records))


def start_metrics(path: Path, keep_before: int | None) -> None:
    """A fresh run (keep_before None) creates the file and never truncates one (FileExistsError: OUT's checks let no
    run through here). A run resumed at step keep_before (0 too: a from-hf run, minidist.convert.runs) keeps the records
    of the steps it does not redo."""
    if keep_before is None:
        out_files.create_empty(path)  # never through a link
        return
    kept = []
    out_files.refuse_link(path)
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash mid-write (or not ours): no step to keep
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] < keep_before:
            kept.append(line + "\n")
    out_files.replace_file(path, "".join(kept).encode())


def jsonable(value: Any) -> Any:
    """Tensors become lists and keys strings, recursively."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


class Clock:
    """Wall time since the loop began and the estimated time to finish."""

    def __init__(self, total: int) -> None:
        self.start = time.perf_counter()
        self.total = total
        self.done = 0

    def tick(self) -> None:
        self.done += 1

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    @property
    def eta(self) -> float:
        return self.elapsed / max(self.done, 1) * (self.total - self.done)


def fmt_time(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def header_lines(cfg: Any, info: dict[str, Any], out: Path) -> list[str]:
    """What the run is, printed once before the first step."""
    entropy = info["unigram_entropy_nats"]
    dims = " ".join(f"{k}{v}" for k, v in info["parallel"].items())
    return [
        f"minidist.train.loop: model {cfg.model} ({info['params'] / 1e6:.2f}M parameters, "
        f"{info['params_non_embedding'] / 1e6:.2f}M non-embedding), world {info['world_size']} ({dims}), "
        f"{info['device']}, {info.get('dtype', cfg.dtype)}, {info['threads']} threads",
        f"data: {info['corpus']}",
        f"unigram entropy of the training split: {entropy:.4f} nats/token ({entropy / math.log(2):.3f} bits): "
        "the loss of a model that knows only token frequencies",
        f"batch {cfg.batch_size} x {cfg.seq_len} = {info['tokens_per_step']:,} tokens/step in "
        f"{cfg.microbatches} micro-batch(es); {cfg.steps} steps; lr {cfg.lr:g} -> {cfg.min_lr:g} "
        f"after {cfg.warmup_steps} warm-up steps",
        f"mfu vs {info['peak_flops_source']}: {info['peak_flops'] / 1e9:,.1f} GFLOP/s per device; "
        f"{info.get('mfu_flops_per_token', info['flops_per_token']) / 1e6:.2f} MFLOP/token ("
        f"{'causal attention, at most: --doc-mask counts each step' if cfg.doc_mask else 'causal attention'}; "
        f"PaLM's full-attention count {info['flops_per_token'] / 1e6:.2f}); writing {out}/",
    ]


def progress_line(record: dict[str, Any], steps: int, clock: Clock) -> str:
    width = len(str(steps))
    line = (f"step {record['step'] + 1:>{width}}/{steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"grad_norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
            f"MFU {record['mfu']:.1%} | ETA {fmt_time(clock.eta)}")
    if "val_loss" in record:
        line += f" | val_loss {record['val_loss']:.4f}"
    return line


def closing_line(summary: dict[str, Any], entropy: float) -> str:
    tail = summary["losses"][-10:]
    val = f", val {summary['final_val_loss']:.4f}" if summary["final_val_loss"] is not None else ""
    return (f"done: {len(summary['steps'])} steps in {fmt_time(summary['elapsed_s'])}; train loss "
            f"{sum(tail) / max(len(tail), 1):.4f} (mean of the last {len(tail)}){val}; unigram entropy "
            f"{entropy:.4f}; {summary['mean_tokens_per_s']:,.0f} tok/s, MFU {summary['cumulative_mfu']:.1%} "
            f"(all steps after the first: their model FLOPs over their time)")


def mean_after_first(values: list[float]) -> float:
    """Mean throughput figure, leaving out the first step (it pays one-time costs: allocation, kernel warm-up)."""
    values = values[1:] or values
    return sum(values) / len(values) if values else 0.0


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far: CUDA tensor bytes on a GPU, peak resident set size on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # macOS reports bytes, Linux kilobytes


def read_figures(steps: list[dict[str, torch.Tensor | float]], device: torch.device) -> list[dict[str, float]]:
    """Each step's figures ({name: 0-d tensor on `device`, or a number}, the same names every step) as floats, in one
    host read for all of them: a read waits for the device, so a window pays it once."""
    if not steps:
        return []
    names = list(steps[0])
    values = torch.stack([torch.stack([torch.as_tensor(f[n], device=device).double() for n in names])
                          for f in steps]).tolist()
    return [dict(zip(names, row)) for row in values]


def synchronize(device: torch.device) -> None:
    """Wait until the device has run every queued kernel (CUDA); a no-op on a CPU, which runs them as they come. The
    step clock stops after it: without it, it would stop when the host had only queued the step."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_per_rank(device: torch.device, comm: Comm) -> list[int]:
    """Every rank's `peak_memory_bytes`, in the rank order of `comm` (the world: one small all-gather)."""
    mine = torch.tensor([peak_memory_bytes(device)], dtype=torch.int64, device=device)
    return [int(v) for v in comm.all_gather(mine).tolist()]
