"""The planner held against published training runs (chapter 12, docs/PUBLISHED_RUNS.md): for each run, the
planner's prediction for that exact layout, the published step time, their ratio, and the place the planner gives
the published layout among the layouts that fit.

The published step time is the one the paper's own figure implies, with this course's FLOP count
(`flops.mfu_flops_per_token`) where the figure is a throughput per GPU:

* Llama 3 405B (Dubey et al. 2024, *The Llama 3 Herd of Models*, Table 4): TP 8, CP 1, PP 16, sequences of 8,192,
  16M tokens per step; DP 64 on 8,192 H100 at 430 TFLOP/s per GPU, DP 128 on 16,384 H100 at 400. FSDP (§3.3.2)
  shards the optimizer state and gradients over the data-parallel replicas and keeps the parameters gathered
  during a step: ZeRO-2's memory for those, taken here as ZeRO-2 or less, whichever the search finds faster.
* DeepSeek-V3 (DeepSeek-AI 2024, *DeepSeek-V3 Technical Report*, §3.1-3.2 and Table 1): 2,048 H800, PP 16, EP 64,
  ZeRO-1 data parallel (DP 128), no TP; 15,360 sequences of 4,096 tokens per step at the end of the batch ramp;
  180K H800 GPU-hours per trillion tokens, i.e. 10^12 / (180,000 · 3,600) tokens per second per GPU.

The run's other settings (micro-batches, virtual stages, recomputation) are left to the search, as `--explain`
leaves them: the fastest variant that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.flops import mfu_flops_per_token
from minidist.model.config import get_preset
from minidist.plan.search import Candidate, Plan, rank_of, search
from minidist.plan.step_time import cluster_for_chip


@dataclass(frozen=True)
class PublishedRun:
    name: str
    model: str
    chip: str
    gpus: int
    seq_len: int
    sequences: int  # per step
    layout: dict  # the published degrees (and ZeRO stage where the paper states it)
    seconds: float  # the published step time (derived from the paper's figure, see `source`)
    source: str


def _from_tflops(model: str, seq_len: int, sequences: int, gpus: int, tflops: float) -> float:
    """Seconds per step implied by `tflops` per GPU, with this course's FLOPs per token."""
    return mfu_flops_per_token(get_preset(model), seq_len) * seq_len * sequences / (gpus * tflops * 1e12)


def published_runs() -> list[PublishedRun]:
    """The runs of the module docstring."""
    llama = dict(tp=8, cp=1, pp=16, ep=1)
    ds_seconds = 4096 * 15360 / (2048 * 1e12 / (180_000 * 3600))
    return [
        PublishedRun("Llama 3 405B, 8,192 H100", "llama3-405b", "H100-SXM", 8192, 8192, 2048, {**llama, "dp": 64},
                     _from_tflops("llama3-405b", 8192, 2048, 8192, 430), "Llama 3 Table 4: 430 TFLOP/s per GPU"),
        PublishedRun("Llama 3 405B, 16,384 H100", "llama3-405b", "H100-SXM", 16384, 8192, 2048, {**llama, "dp": 128},
                     _from_tflops("llama3-405b", 8192, 2048, 16384, 400), "Llama 3 Table 4: 400 TFLOP/s per GPU"),
        PublishedRun("DeepSeek-V3, 2,048 H800", "deepseek-v3", "H800", 2048, 4096, 15360,
                     dict(dp=128, tp=1, cp=1, pp=16, ep=64, zero=1), ds_seconds,
                     "DeepSeek-V3 §1: 180K H800 GPU-hours per trillion tokens"),
    ]


@dataclass(frozen=True)
class Held:
    run: PublishedRun
    predicted: Candidate  # the published layout as the planner sees it
    rank: int | None  # among the layouts that fit (None: it does not fit)
    feasible: int
    best: Candidate  # the planner's first choice

    @property
    def ratio(self) -> float:
        return self.predicted.time.total / self.run.seconds


def hold(run: PublishedRun, plan: Plan | None = None) -> Held:
    """The planner's search for the run's setting (`plan`, else searched here on the chip's cluster with its
    published matmul efficiency) and its published layout's place in it."""
    if plan is None:
        cluster = cluster_for_chip(run.chip, efficiency=None)
        plan = search(get_preset(run.model), run.gpus, run.seq_len, run.seq_len * run.sequences, cluster)
    rank, candidate = rank_of(plan, **run.layout)
    if candidate is None:
        raise ValueError(f"{run.name}: the search has no layout {run.layout}")
    return Held(run, candidate, rank, len(plan.feasible), plan.feasible[0])


def table(held: list[Held]) -> str:
    """The Markdown table of docs/PUBLISHED_RUNS.md and chapter 12."""
    from minidist.plan.search import describe_layout

    lines = ["| published run | layout the planner evaluates | predicted s | published s | ratio | rank |",
             "|---|---|---:|---:|---:|---:|"]
    for h in held:
        place = f"{h.rank} of {h.feasible}" if h.rank else "does not fit"
        lines.append(f"| {h.run.name} | {describe_layout(h.predicted.layout)} | {h.predicted.time.total:.1f} | "
                     f"{h.run.seconds:.1f} | {h.ratio:.2f} | {place} |")
    return "\n".join(lines)
