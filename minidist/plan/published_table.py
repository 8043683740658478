"""The planner against published runs of many sizes (docs/PUBLISHED_RUNS.md, "Many sizes"): each run's model (a
preset or a TOML model table in configs/models/), the stack it ran on (configs/stacks/: its memory rules and what it
could run, as its paper or code states them), its published layout, and the planner's predicted step time and
memory for that layout against the published ones.

For each run the search is restricted to the published degrees and to what the stack could run; the settings the
publication does not state (micro-batches, virtual stages, recomputation, a ZeRO stage the stack leaves open) are
the search's: the fastest variant that fits, else the fastest that does not (`fits` false). A published step time is
the publication's own where it gives one (MT-NLG, Nemotron-4), else the one its throughput implies: tokens per
second per GPU (torchtitan), TFLOP/s per GPU with the FLOP count the publication uses (BLOOM: Megatron's, with
recomputation; Llama 3: this course's, as `published.py`), GPU-hours per trillion tokens (DeepSeek-V3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from minidist.hardware import GIB
from minidist.model.config import ModelConfig
from minidist.plan.cli import stack_cluster
from minidist.plan.cluster import cluster_for_chip
from minidist.plan.model_source import planned_model
from minidist.plan.published import _from_tflops
from minidist.plan.restrict import Restrict, of_stack
from minidist.plan.search import Candidate, describe_layout, search
from minidist.plan.stack import load_stack
from minidist.plan.step_time import DEFAULT_RECIPE, Recipe

# BLOOM (2022) and MT-NLG (2021) ran before FlashAttention reached Megatron-DeepSpeed: the attention scores
# materialized per head, at rates the planner does not charge (it charges FlashAttention-2's)
OLD_KERNELS = ("Megatron-DeepSpeed's 2021-22 kernels: the attention scores materialized (no FlashAttention), no "
               "sequence parallelism; the run's reported throughput is 40-48% of the A100's peak where the planner "
               "charges its GEMMs at the best measured rate (268 of 312 TFLOP/s) and attention at FlashAttention-2's")
REPO = Path(__file__).resolve().parents[2]  # configs/ lives at the repository's root, wherever this runs from
TOLERANCE = 0.25  # every row's predicted step within 25% of the published one, or its reason said


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    model: str  # a preset or configs/models/NAME.toml
    stack: str  # configs/stacks/NAME.toml
    chip: str
    gpus: int
    seq_len: int
    sequences: int  # per step
    layout: dict  # the published settings
    seconds: float  # the published step time (see `source`)
    reported_gib: float | None = None  # memory per GPU the publication reports
    reported_oom: bool = False  # the publication reports this layout out of memory
    memory_gib: float | None = None  # memory per GPU where the run's chip had other than the record's
    recipe: Recipe = DEFAULT_RECIPE
    why_off: str = ""  # why the row may be off by more than `TOLERANCE` (empty: it must not be)
    misses_memory: str = ""  # why the planner calls this published (and run) layout over its memory, if it does
    extra: dict = field(default_factory=dict)


def repo_file(name: str) -> str:
    """A run's model or stack: a preset name as it is, a configs/ file from the repository's root."""
    return str(REPO / name) if name.startswith("configs/") else name


def megatron_step(cfg: ModelConfig, seq_len: int, sequences: int, gpus: int, tflops: float) -> float:
    """Seconds per step implied by `tflops` per GPU in Megatron's count with full recomputation (Narayanan et al.
    2021, eq. 3: 96·B·s·l·h²·(1 + s/6h + V/16lh), the FLOPs of a forward, a recomputed forward and a backward)."""
    b, s, layers, h, v = sequences, seq_len, cfg.n_layers, cfg.d_model, cfg.vocab_size
    flops = 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    return flops / (gpus * tflops * 1e12)


def runs() -> list[Run]:
    """The published runs of docs/PUBLISHED_RUNS.md's "Many sizes" table."""
    llama = dict(tp=8, cp=1, pp=16, ep=1)
    ds_seconds = 4096 * 15360 / (2048 * 1e12 / (180_000 * 3600))
    bloom, _ = planned_model(repo_file("configs/models/bloom-176b.toml"))
    mtnlg = [(2240, 8, 60.1), (2800, 10, 50.2), (3360, 12, 44.4)]
    titan = "torchtitan docs/performance.md (64 A100 80GB, FSDP2): "
    titan_h100 = ("torchtitan benchmarks/llama3_h100_202412_torchtitan.md (H100 96GB HBM2e at 500 W, FSDP2, no "
                  "compile, bf16): ")
    slow_h100 = ("Grand Teton's H100 with 96 GB of HBM2e at 500 W, whose matmul rate no benchmark gives (torchtitan: "
                 "33-39% of the SXM's peak for this model); the planner charges the H100 SXM's measured 792 TFLOP/s")
    return [
        Run("Llama 3 405B, 8,192 H100", "Llama 3 Table 4: 430 TFLOP/s per GPU", "llama3-405b",
            "configs/stacks/llama3.toml", "H100-SXM", 8192, 8192, 2048, {**llama, "dp": 64},
            _from_tflops("llama3-405b", 8192, 2048, 8192, 430)),
        Run("Llama 3 405B, 16,384 H100", "Llama 3 Table 4: 400 TFLOP/s per GPU", "llama3-405b",
            "configs/stacks/llama3.toml", "H100-SXM", 16384, 8192, 2048, {**llama, "dp": 128},
            _from_tflops("llama3-405b", 8192, 2048, 16384, 400)),
        Run("DeepSeek-V3, 2,048 H800", "DeepSeek-V3 §1: 180K H800 GPU-hours per trillion tokens", "deepseek-v3",
            "configs/stacks/deepseek-v3.toml", "H800", 2048, 4096, 15360,
            dict(dp=128, tp=1, cp=1, pp=16, ep=64, zero=1, schedule="dualpipev"), ds_seconds,
            recipe=Recipe(fp8="blockwise", max_nodes=4, comm_sms=20, mtp_depth=1)),
        Run("BLOOM 176B, 384 A100", "BigScience: about 150 TFLOP/s per GPU; 48 GPUs per replica using 60 GB each; "
            "tr11-176B-ml.slurm: micro-batches of 2, --checkpoint-activations", "configs/models/bloom-176b.toml",
            "configs/stacks/megatron-deepspeed.toml", "A100", 384, 2048, 2048,
            dict(tp=4, pp=12, dp=8, cp=1, ep=1, microbatches=2048 // (8 * 2), recompute="full"),
            megatron_step(bloom, 2048, 2048, 384, 150), reported_gib=60e9 / GIB,
            why_off=OLD_KERNELS + "; its nodes had four 100 Gb/s Omni-Path links for 8 GPUs (50 Gb/s per GPU), the "
                    "planner's A100 nodes one 200 Gb/s port per GPU; its launch script sets CUDA_LAUNCH_BLOCKING=1"),
        *[Run(f"MT-NLG 530B, {gpus:,} A100", f"MT-NLG §2.4: {seconds} s per iteration",
              "configs/models/mt-nlg-530b.toml", "configs/stacks/megatron-deepspeed.toml", "A100", gpus, 2048, 1920,
              dict(tp=8, pp=35, dp=dp, cp=1, ep=1), seconds, why_off=OLD_KERNELS) for gpus, dp, seconds in mtnlg],
        Run("Nemotron-4 340B, 6,144 H100", "Nemotron-4 340B report Table 2: 8.0 s per iteration",
            "configs/models/nemotron4-340b.toml", "configs/stacks/megatron-core.toml", "H100-SXM", 6144, 4096, 2304,
            dict(tp=8, pp=12, dp=64, cp=1, ep=1), 8.0,
            why_off="on the fast side, as Llama 3's 16,384-GPU row (0.78): what the planner leaves out (GEMM rates by "
                    "shape, element-wise kernels beyond one pass each, the optimizer step) lengthens real steps"),
        Run("torchtitan Llama 3 8B, 64 A100", titan + "2,973 tokens/s per GPU, local batch 1, selective AC",
            "llama3-8b", "configs/stacks/torchtitan-fused-rmsnorm.toml", "A100", 64, 8192, 64,
            dict(dp=64, tp=1, pp=1, cp=1, ep=1, microbatches=1, recompute="selective"), 8192 / 2973),
        Run("torchtitan Llama 3 70B, 64 A100", titan + "331 tokens/s per GPU, local batch 1, full AC",
            "configs/models/llama3-70b.toml", "configs/stacks/torchtitan.toml", "A100", 64, 8192, 64,
            dict(dp=64, tp=1, pp=1, cp=1, ep=1, microbatches=1, recompute="full"), 8192 / 331),
        Run("torchtitan Llama 2 13B, 64 A100", titan + "2,162 tokens/s per GPU, local batch 2, no AC",
            "configs/models/llama2-13b.toml", "configs/stacks/torchtitan-fused-rmsnorm.toml", "A100", 64, 4096, 128,
            dict(dp=64, tp=1, pp=1, cp=1, ep=1, microbatches=1, recompute="none"), 2 * 4096 / 2162),
        *[Run(f"torchtitan Llama 3.1 8B, {gpus} H100", titan_h100 + f"{tps:,} tokens/s per GPU and {gib} GiB (peak "
              "reserved), local batch 2, selective op AC", "llama3-8b", "configs/stacks/torchtitan.toml", "H100-SXM",
              gpus, 8192, 2 * gpus, dict(dp=gpus, tp=1, pp=1, cp=1, ep=1, microbatches=1, recompute="selective"),
              2 * 8192 / tps, reported_gib=gib, memory_gib=96e9 / GIB, why_off=slow_h100)
          for gpus, tps, gib in ((8, 5762, 82.4), (128, 5605, 67.0))],
        Run("torchtitan Llama 2 70B, 64 A100", titan + "353 tokens/s per GPU, local batch 2, full AC",
            "llama2-70b", "configs/stacks/torchtitan.toml", "A100", 64, 4096, 128,
            dict(dp=64, tp=1, pp=1, cp=1, ep=1, microbatches=1, recompute="full"), 2 * 4096 / 353),
        Run("torchtitan Llama 2 70B, 64 A100, selective AC", titan + "local batch 2 with selective AC: out of memory",
            "llama2-70b", "configs/stacks/torchtitan.toml", "A100", 64, 4096, 128,
            dict(dp=64, tp=1, pp=1, cp=1, ep=1, microbatches=1, recompute="selective"), 2 * 4096 / 353,
            reported_oom=True, why_off="out of memory: no step was published (the full-AC row's time, for reference)"),
    ]


def parallelism_only(run: Run) -> bool:
    """Whether the run needs nothing beyond chapters 00-11 (chapter 12's rows): 1F1B or interleaved pipelines, no
    FP8 (chapter 16), no multi-token prediction."""
    return set(load_stack(repo_file(run.stack)).schedules) <= {"1f1b", "interleaved"} and not run.recipe.fp8 and \
        not run.recipe.mtp_depth


@dataclass(frozen=True)
class Predicted:
    run: Run
    candidate: Candidate  # the published layout as the planner sees it (its fastest variant that fits, if any)
    fits: bool
    gib: float  # its heaviest stage's bytes, in GiB (the stack's reserved GiB not included)
    usable_gib: float
    reserved_gib: float  # what the stack reserves per GPU (CUDA context, NCCL, the allocator's slack)

    @property
    def ratio(self) -> float:
        return self.candidate.time.total / self.run.seconds


def predict(run: Run) -> Predicted:
    """The planner's search for the run, restricted to its published settings and its stack's abilities."""
    cfg, _ = planned_model(repo_file(run.model))
    stack = load_stack(repo_file(run.stack))
    cluster = stack_cluster(cluster_for_chip(run.chip, efficiency=None), stack, run.memory_gib)
    restrict = of_stack(stack).joined(Restrict(tuple((k, (v,)) for k, v in run.layout.items())))
    plan = search(cfg, run.gpus, run.seq_len, run.seq_len * run.sequences, cluster, stack.precision, run.recipe,
                  restrict)
    if not plan.feasible and not plan.rejected:
        raise ValueError(f"{run.name}: the search has no layout {run.layout}")
    candidate = plan.feasible[0] if plan.feasible else plan.heaviest(plan.rejected[0])
    return Predicted(run, candidate, bool(plan.feasible), candidate.memory.total / GIB, cluster.budget / GIB,
                     stack.reserved_bytes(cluster.memory_bytes) / GIB)


def table(rows: list[Predicted]) -> str:
    """The Markdown table of docs/PUBLISHED_RUNS.md's "Many sizes"."""
    lines = ["| published run | stack | layout the planner evaluates | predicted s | published s | ratio | fits "
             "(GiB of usable) | memory with the reserve vs reported |", "|---|---|---|---:|---:|---:|---|---|"]
    for p in rows:
        reported = "out of memory" if p.run.reported_oom else \
            f"{p.gib:.1f} + {p.reserved_gib:.1f} vs {p.run.reported_gib:.1f} GiB" if p.run.reported_gib else "-"
        fits = f"{'yes' if p.fits else 'no'} ({p.gib:.1f} of {p.usable_gib:.1f})"
        lines.append(f"| {p.run.name} | {p.run.stack.rsplit('/', 1)[-1]} | {describe_layout(p.candidate.layout)} | "
                     f"{p.candidate.time.total:.2f} | {p.run.seconds:.2f} | {p.ratio:.2f} | {fits} | {reported} |")
    return "\n".join(lines)
