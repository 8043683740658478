"""--profile-steps A:B: a `torch.profiler` trace of steps A..B per rank, for Perfetto (ui.perfetto.dev) or
chrome://tracing.

Steps count as metrics.jsonl counts them (0-based), both ends included. The profiler starts before step A's work
and stops after step B's (on CUDA after a synchronize, so the trace holds B's kernels), then each rank writes
OUT/profile/rank{R}_steps{A}-{B}.json. Every profiled step is one labelled range (`step N`), inside it
`forward_backward` (each micro-batch's forward labelled `forward`; the autograd backward is torch's own events),
`clip_grad_norm` (where data parallelism waits for its gradient buckets) and `optimizer_step`; the collectives are
the backend's own events (gloo's on a CPU, NCCL's kernels on a GPU), so a bucket's all-reduce can be seen beside
the backward it overlaps. CPU activity always; CUDA activity on CUDA. Outside A..B nothing is recorded.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from minidist import out_files

DIRECTORY = "profile"
Autocast = Callable[[], contextlib.AbstractContextManager]


def parse_profile_steps(text: str, steps: int) -> tuple[int, int]:
    """'A:B' as (A, B), 0 <= A <= B < steps; a one-line ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if match is None:
        raise ValueError(f"--profile-steps {text!r} is not A:B, two step indices (0-based, as metrics.jsonl counts "
                         "them), e.g. 10:12")
    first, last = int(match[1]), int(match[2])
    if first > last:
        raise ValueError(f"--profile-steps {text}: {first} comes after {last}; the first step comes first "
                         f"({last}:{first})")
    if last >= steps:
        raise ValueError(f"--profile-steps {text}: step {last} is past the run's last step, {steps - 1} (--steps "
                         f"{steps}, counted from 0)")
    return first, last


def activities(device: torch.device) -> list[ProfilerActivity]:
    return [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device.type == "cuda" else [])]


def no_label(name: str) -> contextlib.AbstractContextManager:
    """A step's phase outside a profiled step: nothing (not even a profiler call: no dispatched operator)."""
    return contextlib.nullcontext()


def labelled(autocast: Autocast, name: str) -> Autocast:
    """`autocast` that also opens the profiler range `name`: the model's forwards run inside it."""

    @contextlib.contextmanager
    def enter() -> Iterator[None]:
        with record_function(name), autocast():
            yield

    return enter


class StepProfiler:
    """The profiler of one rank's run: `step(n, autocast)` around each step's work, `close()` after the loop (a run
    that stops inside A..B, at --stop-after, writes the steps it ran)."""

    def __init__(self, spec: str | None, steps: int, out: Path, rank: int, device: torch.device) -> None:
        self.range = parse_profile_steps(spec, steps) if spec else None
        self.out, self.rank, self.device = Path(out), rank, device
        self.profiler: profile | None = None
        self.first: int | None = None  # the first step profiled (a resumed run may start inside A..B)
        self.last: int | None = None
        self.written: Path | None = None

    def skipped(self, start_step: int) -> str | None:
        """The line to say when a resumed run starts after the whole range: it profiles nothing."""
        if self.range is None or self.range[1] >= start_step:
            return None
        return (f"--profile-steps {self.range[0]}:{self.range[1]}: those steps ran before step {start_step}, where "
                "this run resumes; nothing is profiled")

    @contextlib.contextmanager
    def step(self, step: int, autocast: Autocast) -> Iterator[tuple[Autocast, Callable[[str], Any]]]:
        """Around one step's work: yields the autocast the step's forwards use and the label of its phases, both
        opening profiler ranges in a profiled step only."""
        if self.range is None or not self.range[0] <= step <= self.range[1]:
            yield autocast, no_label
            return
        if self.profiler is None:
            self.profiler, self.first = profile(activities=activities(self.device)), step
            self.profiler.start()
        self.last = step
        try:
            with record_function(f"step {step}"):
                yield labelled(autocast, "forward"), record_function
        except BaseException:
            with contextlib.suppress(Exception):  # the trace up to the failure, if it can be had; the failure wins
                self.close()
            raise
        if step == self.range[1]:
            self.close()

    def close(self) -> None:
        """Stop the profiler, if it runs, and write this rank's trace."""
        if self.profiler is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the last step's kernels, still queued, belong in the trace
        self.profiler.stop()
        self.written = self._export(self.out / DIRECTORY / f"rank{self.rank}_steps{self.first}-{self.last}.json")
        self.profiler = None

    def _export(self, path: Path) -> Path:
        """Write the trace to a fresh temporary directory beside `path`, then rename it there: the profiler opens
        the file by name, and a link planted at `path` is replaced, never followed."""
        out_files.refuse_link(path.parent)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".trace.") as tmp:
            staged = Path(tmp) / path.name
            self.profiler.export_chrome_trace(str(staged))
            os.replace(staged, path)
        return path

