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

Llama 3 is searched with Megatron-LM's kernels' saved activations (`rank_memory.BF16_MEGATRON`: its stack fuses
RMSNorm, RoPE and SwiGLU and keeps sequence-parallel inputs sharded); DeepSeek-V3 with its own stack
(`rank_memory.BF16_DEEPSEEK`: fp32 gradients, bf16 AdamW moments, §3.3.3; its kernels' activations, FP8 copies with
the norms and MLA's up-projections recomputed, §3.2.3 and §3.3.2, `plan.deepseek_saves`) and recipe
(`step_time.Recipe`: FP8 blockwise GEMMs in the blocks' linears, each token's experts on at most 4 nodes, the
all-to-all on 20 SMs, one multi-token-prediction module, §2.2, `plan.mtp`) and DualPipe, here its V form
(`dualpipev`: the same overlapped pairs, half the parameter copies). The run's other settings
(micro-batches, virtual stages, recomputation) are left to the search, as `--explain` leaves them: the fastest
variant that fits. The 16,384-GPU run is held a second time with this trainer's kernels (`rank_memory.BF16_MIXED`),
under which its shape fits only with full recomputation: the papers do not give the activation memory that would
tell the two apart. `Held.rank_available` places the published layout among the layouts that use only what the run
had: Llama 3's stack ran 1F1B / interleaved schedules (§3.3.2), not the zero-bubble ones (Qi et al., November 2023)
nor DualPipe (December 2024, after it), and its context parallelism all-gathers K and V (§3.3.2), with the
all-gather exposed, not a ring overlapped with attention.
"""

from __future__ import annotations

from dataclasses import dataclass

from minidist.flops import mfu_flops_per_token
from minidist.model.config import get_preset
from minidist.parallel.layout import Layout
from minidist.parallel.pp.schedules import ZB_SCHEDULES
from minidist.plan.cluster import cluster_for_chip
from minidist.plan.rank_memory import BF16_DEEPSEEK, BF16_MEGATRON, BF16_MIXED, Precision
from minidist.plan.search import CP_IMPLS, Candidate, Plan, describe_layout, rank_of, search
from minidist.plan.step_time import DEFAULT_RECIPE, Recipe


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
    recipe: Recipe = DEFAULT_RECIPE
    precision: Precision = BF16_MEGATRON
    unavailable: tuple[str, ...] = ()  # schedules the run's stack did not have
    cp_impls: tuple[str, ...] = CP_IMPLS  # the context-parallel attention its stack had

    def had(self, layout: Layout) -> bool:
        """Whether the run's stack could run `layout`: its schedule, and its context parallelism if any."""
        o = layout.options
        return o.schedule not in self.unavailable and (layout.dims.cp == 1 or o.cp_impl in self.cp_impls)


def _from_tflops(model: str, seq_len: int, sequences: int, gpus: int, tflops: float) -> float:
    """Seconds per step implied by `tflops` per GPU, with this course's FLOPs per token."""
    return mfu_flops_per_token(get_preset(model), seq_len) * seq_len * sequences / (gpus * tflops * 1e12)


def published_runs() -> list[PublishedRun]:
    """The runs of the module docstring."""
    llama = dict(tp=8, cp=1, pp=16, ep=1)
    # what Llama 3's stack had (§3.3.2): 1F1B / interleaved schedules, context parallelism by all-gathering K and V
    llama_stack = dict(unavailable=ZB_SCHEDULES, cp_impls=("allgather",))
    ds_seconds = 4096 * 15360 / (2048 * 1e12 / (180_000 * 3600))
    return [
        PublishedRun("Llama 3 405B, 8,192 H100", "llama3-405b", "H100-SXM", 8192, 8192, 2048, {**llama, "dp": 64},
                     _from_tflops("llama3-405b", 8192, 2048, 8192, 430), "Llama 3 Table 4: 430 TFLOP/s per GPU",
                     **llama_stack),
        PublishedRun("Llama 3 405B, 16,384 H100", "llama3-405b", "H100-SXM", 16384, 8192, 2048, {**llama, "dp": 128},
                     _from_tflops("llama3-405b", 8192, 2048, 16384, 400), "Llama 3 Table 4: 400 TFLOP/s per GPU",
                     **llama_stack),
        PublishedRun("Llama 3 405B, 16,384 H100, this trainer's kernels", "llama3-405b", "H100-SXM", 16384, 8192,
                     2048, {**llama, "dp": 128}, _from_tflops("llama3-405b", 8192, 2048, 16384, 400),
                     "Llama 3 Table 4: 400 TFLOP/s per GPU", precision=BF16_MIXED, **llama_stack),
        PublishedRun("DeepSeek-V3, 2,048 H800", "deepseek-v3", "H800", 2048, 4096, 15360,
                     dict(dp=128, tp=1, cp=1, pp=16, ep=64, zero=1, schedule="dualpipev"), ds_seconds,
                     "DeepSeek-V3 §1: 180K H800 GPU-hours per trillion tokens",
                     Recipe(fp8="blockwise", max_nodes=4, comm_sms=20, mtp_depth=1),
                     precision=BF16_DEEPSEEK),
    ]


@dataclass(frozen=True)
class Held:
    run: PublishedRun
    predicted: Candidate  # the published layout as the planner sees it (its fastest variant the run could run)
    rank: int | None  # among the layouts that fit (None: it does not fit)
    feasible: int
    best: Candidate  # the planner's first choice
    rank_available: int | None  # among the layouts that fit and use only what the run had (None: not among them)
    available: int

    @property
    def ratio(self) -> float:
        return self.predicted.time.total / self.run.seconds


def hold(run: PublishedRun, plan: Plan | None = None) -> Held:
    """The planner's search for the run's setting (`plan`, else searched here on the chip's cluster with its
    published matmul efficiency) and its published layout's place in it."""
    if plan is None:
        cluster = cluster_for_chip(run.chip, efficiency=None)
        plan = search(get_preset(run.model), run.gpus, run.seq_len, run.seq_len * run.sequences, cluster,
                      run.precision, run.recipe)
    had = [c for c in plan.feasible if run.had(c.layout)]
    place, candidate = rank_of(Plan(had, []), **run.layout)  # the fastest variant the run's stack could run
    if candidate is None:  # it fits only with what the run's stack lacked (no place among what it had), or not at all
        candidate = rank_of(plan, **run.layout)[1]
    if candidate is None:
        raise ValueError(f"{run.name}: the search has no layout {run.layout}")
    rank = next((i for i, c in enumerate(plan.feasible, 1) if c is candidate), None)
    return Held(run, candidate, rank, len(plan.feasible), plan.feasible[0], place, len(had))


def table(held: list[Held]) -> str:
    """The Markdown table of docs/PUBLISHED_RUNS.md and chapter 12."""
    lines = ["| published run | layout the planner evaluates | predicted s | published s | ratio | rank | rank among "
             "what the run had |", "|---|---|---:|---:|---:|---:|---:|"]
    for h in held:
        place = f"{h.rank} of {h.feasible}" if h.rank else "does not fit"
        had = f"{h.rank_available} of {h.available}" if h.rank_available else \
            "does not fit" if h.rank is None else "fits only with what it lacked"
        lines.append(f"| {h.run.name} | {describe_layout(h.predicted.layout)} | {h.predicted.time.total:.2f} | "
                     f"{h.run.seconds:.2f} | {h.ratio:.2f} | {place} | {had} |")
    return "\n".join(lines)
