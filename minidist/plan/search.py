"""The layout search (chapter 12): `search` lists the layouts that fit the chip's memory, fastest predicted first,
and `format_plan` reports them; `python -m minidist.plan` (`cli`) runs it from the command line.

It searches the degrees dp, tp, pp, cp, ep (dp·tp·pp·cp = the GPUs; ep carved out of dp·cp), the ZeRO stage, the
number of micro-batches, the pipeline schedule (1F1B, interleaved over 2, 4 or 8 virtual stages, and chapter 15's
ZB-H1, ZB-V and DualPipeV: `pipeline_schedules`) and the recomputation. Memory per rank is `rank_memory` (bf16
mixed precision: 2 + 2 + 12 bytes per parameter; the activations as this trainer's kernels keep them, or
Megatron-LM's with `--kernels megatron`); step time is `step_time` (FLOPs at a stated fraction of the peak, FP8's
with `--fp8`, the α-β model per dimension over NVLink or the network, the bubble for each schedule's T_F:T_B:T_W,
what overlaps, DualPipeV's overlapped pairs; node-limited routing with `--max-nodes`).
The rules that bound the search (each refused layout is counted with its reason):

* tp divides the heads; beyond a node its all-reduces cross the network (`hardware.link_of`), which the step time
  charges: it keeps the compute per GPU and sends its all-reduces over the network several times a layer, so it
  is tried only for a (pp, cp) where no layout with tp inside a node fits (the smaller degrees are searched
  first); sequence parallel is on whenever tp > 1 (the same bytes as plain TP, less activation memory);
* cp divides the sequence into 2·cp chunks (the ring's zig-zag split) of together at least `MIN_CP_TOKENS` tokens
  per rank; pp ≤ layers, the interleaved schedule and ZB-H1 need micro-batches ≥ pp, ZB-V and DualPipeV ≥ 2·pp;
  chunks may be uneven (pp·v ≤ layers + 2: the embedding and the head take a layer's slot, as in Llama 3; the
  trainer itself runs equal chunks only); recomputation none, selective (not with cp > 1) or full;
* dp divides the global batch's sequences, micro-batches divide each replica's sequences, at least pp of them
  (fewer leave every stage idle over half the step); without a pipeline, more micro-batches than the fewest that
  fit are never faster, so the search stops there;
* ep divides dp·cp and the number of experts;
* a layout that fits with less recomputation is not listed again with more (never faster);
* what the stack can run and `--restrict` names (`restrict.Restrict`); with `--micro-batch-size B` the
  micro-batches are the replica's sequences / B, and a dp whose dp·B does not divide the global batch is refused.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import typing
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from minidist.comm.topology import ParallelDims
from minidist.flops import count_params
from minidist.hardware import GIB
from minidist.model.config import ModelConfig
from minidist.model.fp8_linear import RECIPES as FP8_RECIPES
from minidist.parallel.layout import Layout, ParallelOptions
from minidist.plan import mtp
from minidist.plan.cluster import Cluster, attention_source, efficiency_source, elementwise_source, fp8_source
from minidist.plan.explain import LEFT_OUT, evaluate
from minidist.plan.rank_memory import (
    BF16_MIXED,
    MEMORY_TERMS,
    MemoryEstimate,
    Precision,
    estimate_memory,
    precision_words,
)
from minidist.plan.restrict import ANYTHING, Restrict
from minidist.plan.step_time import DEFAULT_RECIPE, Recipe, StepTime, predict_step, token_flops

# Context parallelism below this many tokens per rank multiplies small matmuls and messages, whose inefficiency the
# cost model does not see (it charges FLOPs at one efficiency): the search leaves such layouts out.
MIN_CP_TOKENS = 1024
FP8_CHOICES = ("none", *FP8_RECIPES)  # the trainer's --fp8 recipes
JSON_KEYS = ("dp", "tp", "pp", "cp", "ep", "zero", "schedule", "microbatches", "virtual_stages", "recompute",
             "cp_impl", "mem_gib", "step_s", "fits", "heaviest_stage")
# context parallelism's implementations the search tries: the ring (its sends overlap the attention) and the
# all-gather Llama 3 runs (exposed, but simple with document masks); Ulysses (heads over cp) is left to --explain
CP_IMPLS = ("ring", "allgather")


@dataclass
class Candidate:
    layout: Layout
    memory: MemoryEstimate  # of the heaviest pipeline stage (`memory.stage`), unless `over_at_first_stage`
    time: StepTime
    fits: bool = True
    # the search's shortcut for a layout whose first stage alone is over the budget: `memory` is that stage's
    # (`Plan.heaviest` completes it; most layouts of a large search are rejected so, at a fifth of the cost)
    over_at_first_stage: bool = False

    def row(self) -> dict:
        values = {**self.layout.flat(), "mem_gib": round(self.memory.total / GIB, 2),
                  "step_s": round(self.time.total, 4), "fits": self.fits, "heaviest_stage": self.memory.stage}
        return {key: values[key] for key in JSON_KEYS}


@dataclass
class Plan:
    feasible: list[Candidate]  # fastest first
    rejected: list[Candidate]  # over the memory budget, fastest first
    refused: Counter = field(default_factory=Counter)  # reasons a point of the grid is not a layout, with counts
    budget: float = 0.0  # usable bytes per chip
    recipe: Recipe = DEFAULT_RECIPE  # FP8, node-limited routing: as the search assumed them
    precision: Precision = BF16_MIXED  # bytes per parameter and activation, the kernels' saved tensors
    memory_of: Callable[[Layout], MemoryEstimate] | None = None  # a layout's heaviest stage, as the search counts

    def heaviest(self, candidate: Candidate) -> Candidate:
        """`candidate` with the memory of its heaviest stage (a rejected one may carry only its first stage's)."""
        if not candidate.over_at_first_stage or self.memory_of is None:
            return candidate
        return dataclasses.replace(candidate, memory=self.memory_of(candidate.layout), over_at_first_stage=False)


def parse_tokens(text: str) -> int:
    """'4M' -> 4,194,304: K, M, G are powers of two (2^10, 2^20, 2^30); a plain integer is taken as it is."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    raw = text.strip().upper().replace(",", "").replace("_", "")
    scale = units.get(raw[-1:], 1)
    digits = raw[:-1] if raw[-1:] in units else raw
    if not digits.isdigit() or int(digits) < 1:
        raise ValueError(f"--global-batch-tokens {text!r} is not a positive whole number of tokens "
                         "(e.g. 4194304, 4096K or 4M; K/M/G are powers of two)")
    return int(digits) * scale


def global_batch_sequences(tokens: int, seq_len: int) -> int:
    """Sequences in a global batch of `tokens` tokens; a one-line error when seq_len does not divide it."""
    if seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {seq_len}")
    if tokens % seq_len:
        low = tokens // seq_len * seq_len
        fits = f"{low:,} ({low // seq_len} sequences) or " if low else ""
        raise ValueError(f"--global-batch-tokens {tokens:,} is not a multiple of --seq-len {seq_len}; "
                         f"{fits}{low + seq_len:,} ({low // seq_len + 1} sequences) would fit")
    return tokens // seq_len


@functools.lru_cache(maxsize=4096)
def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of n, ascending, by trial division up to √n (10^12 in about 0.1 s; O(n) hung on large inputs)."""
    small, large = [], []
    d = 1
    while d * d <= n:
        if n % d == 0:
            small.append(d)
            if d * d != n:
                large.append(n // d)
        d += 1
    return tuple(small + large[::-1])


def most_gpus(cfg: ModelConfig, seq_len: int, sequences: int, gpus_per_node: int) -> int:
    """The most GPUs any layout of the search can use: every sequence its own replica, tp a head each, cp down to
    `MIN_CP_TOKENS` per rank, a stage per layer."""
    return sequences * cfg.n_heads * max(seq_len // MIN_CP_TOKENS, 1) * cfg.n_layers


def candidate_layouts(cfg: ModelConfig, gpus: int, seq_len: int, sequences: int, cluster: Cluster,
                      refused: Counter, restrict: Restrict = ANYTHING) -> typing.Iterator[Layout]:
    """Every layout of the search space that the rules and `restrict` admit; refused grid points are counted by
    reason."""
    experts, size = cfg.moe.n_experts, restrict.micro_batch_size
    sp = restrict.values("sequence_parallel") != (False,)  # a stack without sequence parallelism
    for tp, cp in itertools.product(_divisors(gpus), _divisors(gpus)):
        if gpus % (tp * cp) or not (restrict.admits_degree("tp", tp) and restrict.admits_degree("cp", cp)):
            continue
        if tp > 1 and cfg.n_heads % tp:
            refused[f"tp={tp}: must divide {cfg.n_heads} heads"] += 1
            continue
        if cp > 1 and seq_len % (2 * cp):
            refused[f"cp={cp}: the {seq_len}-token sequence does not split into 2·cp chunks"] += 1
            continue
        if cp > 1 and seq_len // cp < MIN_CP_TOKENS:
            refused[f"cp={cp}: fewer than {MIN_CP_TOKENS} tokens of each sequence per rank"] += 1
            continue
        for pp in _divisors(gpus // (tp * cp)):
            dp = gpus // (tp * cp * pp)
            if not (restrict.admits_degree("pp", pp) and restrict.admits_degree("dp", dp)):
                continue
            if pp > cfg.n_layers:
                refused[f"pp={pp}: more stages than the {cfg.n_layers} layers"] += 1
                continue
            if sequences % dp:
                refused[f"dp={dp}: the global batch of {sequences} sequences does not split over it"] += 1
                continue
            eps = [e for e in _divisors(math.gcd(dp * cp, experts))] if experts else [1]
            per_replica = sequences // dp
            if size and per_replica % size:
                refused[f"dp={dp}: dp x B = {dp * size} does not divide the {sequences} sequences"] += 1
                continue
            # Fewer micro-batches than stages would leave every stage idle for over half the step.
            micro = [per_replica // size] if size else \
                [m for m in _divisors(per_replica) if m >= pp or m == per_replica]
            if not size and len(micro) < len(_divisors(per_replica)):
                refused[f"pp={pp}: fewer micro-batches than stages (bubble over half the step)"] += 1
            recomputes = ("none", "full") if cp > 1 else ("none", "selective", "full")  # as the trainer runs them
            impls = CP_IMPLS if cp > 1 else ("ring",)
            for ep, zero, m, recompute, impl in itertools.product(eps, range(4), micro, recomputes, impls):
                dims = ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
                for schedule, v in pipeline_schedules(cfg.n_layers, pp, m):
                    options = ParallelOptions(sequence_parallel=tp > 1 and sp, schedule=schedule, microbatches=m,
                                              virtual_stages=v, zero=zero, cp_impl=impl)
                    layout = Layout(dims, options, recompute)
                    if restrict.admits(layout):
                        yield layout


def pipeline_schedules(n_layers: int, pp: int, microbatches: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) the search tries for a pipeline of pp stages and m micro-batches: 1F1B; the
    interleaved schedule over 2, 4, 8 chunks per rank (m >= p); ZB-H1 (m >= p); ZB-V and DualPipeV, two chunks per
    rank in a V (m >= 2p). Chunks may be uneven, as Llama 3 makes them (its first and last stage one layer fewer:
    the embedding and the head take a layer's slot), so up to two chunks hold no block (`chunk_layers` leaves the
    last ones short); the trainer itself runs interleaving and the V only with equal chunks."""
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1)]
    if microbatches >= pp:
        out += [("interleaved", v) for v in (2, 4, 8) if pp * v <= n_layers + 2] + [("zb1", 1)]
    if microbatches >= 2 * pp and 2 * pp <= n_layers + 2:
        out += [("zbv", 1), ("dualpipev", 1)]
    return out


def check_search(cfg: ModelConfig, gpus: int, seq_len: int, sequences: int, cluster: Cluster, precision: Precision,
                 recipe: Recipe) -> None:
    """A one-line ValueError for a search no layout could answer, or one whose kernels and recipe disagree."""
    if gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    most = most_gpus(cfg, seq_len, sequences, cluster.gpus_per_node)
    if gpus > most:
        raise ValueError(f"--gpus {gpus:,} is more than any layout can use for {sequences:,} sequences of {seq_len} "
                         f"tokens ({most:,}: dp up to the sequences, tp a node, cp to {MIN_CP_TOKENS} tokens per "
                         "rank, pp a layer per stage); use fewer GPUs or a larger --global-batch-tokens")
    if precision.fp8_saved and not recipe.fp8:
        raise ValueError("DeepSeek-V3's kernels keep the linears' inputs in FP8 (§3.3.2): plan them with an FP8 "
                         "recipe (--fp8 blockwise, as DeepSeek-V3 trained)")


def search(cfg: ModelConfig, gpus: int, seq_len: int, global_tokens: int, cluster: Cluster,
           precision: Precision = BF16_MIXED, recipe: Recipe = DEFAULT_RECIPE, restrict: Restrict = ANYTHING) -> Plan:
    """Every admitted layout (`restrict`: what the stack and the user allow) with its memory and predicted step
    time, split by whether it fits the chip."""
    sequences = global_batch_sequences(global_tokens, seq_len)
    check_search(cfg, gpus, seq_len, sequences, cluster, precision, recipe)
    cfg = mtp.with_mtp(cfg, recipe.mtp_depth)  # its blocks as layers after the last, for the stages to split
    refused: Counter = Counter()
    feasible, rejected = [], []
    per_token = token_flops(cfg, seq_len, recipe.mtp_depth)
    memo: dict = {}  # pieces of the memory model shared by many layouts (`estimate_memory`)
    time_memo: dict = {}  # and of the step time (`predict_step`)
    fits_with: dict[tuple, int] = {}  # without a pipeline: the fewest micro-batches that fit, per other settings
    fits_lighter: set[tuple] = set()  # (dims, options) of layouts that fit with less recomputation
    fits_in_node: set[tuple] = set()  # (pp, cp) with a layout that fits with tp inside a node
    ring_over: set[tuple] = set()  # ring-attention layouts over the budget, but for their cp_impl
    for layout in candidate_layouts(cfg, gpus, seq_len, sequences, cluster, refused, restrict):
        dims, o, m = layout.dims, layout.options, layout.options.microbatches
        lighter = (layout.dims, layout.options)
        # the settings a search varies, less the micro-batches and the context-parallel implementation (the options
        # `candidate_layouts` holds fixed, e.g. loss_chunk, are left out: add any it comes to vary)
        settings = (dims, o.schedule, o.virtual_stages, o.zero, layout.recompute)
        if dims.tp > cluster.gpus_per_node and (dims.pp, dims.cp) in fits_in_node:
            continue  # tp over the network: a memory measure, tried where tp inside a node fits nothing
        if lighter in fits_lighter:
            # none, selective, full come in that order: more recomputation of a layout that fits with less is
            # never faster (the same communication or more, the same compute or more), so it is not evaluated
            continue
        others = (settings, o.cp_impl) if dims.pp == 1 else None
        if others is not None and fits_with.get(others, m) < m:
            # More micro-batches than the fewest that fit only add latency (more, smaller collectives; ZeRO-2/3
            # communicates per micro-batch): never faster, so not evaluated.
            continue
        if layout.recompute == "selective" and precision.fp8_saved:
            continue  # DeepSeek-V3's kernels already recompute their element-wise parts (`deepseek_saves`)
        if o.cp_impl != "ring" and (settings, m) in ring_over:
            continue  # it keeps all the ring keeps and the whole sequence's keys and values: over too, not listed
        first = estimate_memory(cfg, layout, seq_len, sequences // (dims.dp * m), precision, stage=0, memo=memo,
                                mtp_depth=recipe.mtp_depth)
        if first.total > cluster.budget:  # over on its first stage: it cannot fit, whichever stage is heaviest
            time = predict_step(cfg, layout, seq_len, sequences, cluster, precision, per_token, recipe, time_memo)
            candidate = Candidate(layout, first, time, False, over_at_first_stage=True)
        else:
            candidate = Candidate(layout, *evaluate(cfg, layout, seq_len, sequences, cluster, precision, recipe,
                                                    per_token, memo, time_memo))
        (feasible if candidate.fits else rejected).append(candidate)
        if not candidate.fits and dims.cp > 1 and o.cp_impl == "ring":
            ring_over.add((settings, m))
        elif candidate.fits:
            fits_lighter.add(lighter)
            fits_in_node.update([(dims.pp, dims.cp)] if dims.tp <= cluster.gpus_per_node else [])
            if dims.pp == 1:
                fits_with.setdefault(others, m)
    feasible.sort(key=lambda c: (c.time.total, c.memory.total))  # equal times: the smaller footprint first
    rejected.sort(key=lambda c: (c.time.total, c.memory.total))  # memory: a lower bound where over at stage 0

    def memory_of(layout: Layout) -> MemoryEstimate:
        micro_batch = sequences // (layout.dims.dp * layout.options.microbatches)
        return estimate_memory(cfg, layout, seq_len, micro_batch, precision, memo=memo, mtp_depth=recipe.mtp_depth)
    return Plan(feasible, rejected, refused, cluster.budget, recipe, precision, memory_of)


def rank_of(plan: Plan, **degrees: int) -> tuple[int | None, Candidate | None]:
    """The place (1 = fastest) of the fastest feasible layout with these settings (`Layout.of`'s flat names, e.g.
    dp=128, tp=8, pp=16, zero=1) and that layout; (None, the fastest rejected one) when none fits; (None, None) when
    the search has none."""
    def match(c: Candidate) -> bool:
        flat = c.layout.flat()
        return all(flat[k] == v for k, v in degrees.items())
    for i, c in enumerate(plan.feasible, 1):
        if match(c):
            return i, c
    rejected = next((c for c in plan.rejected if match(c)), None)
    return None, rejected and plan.heaviest(rejected)


def why_rejected(candidate: Candidate, budget: float) -> str:
    """One line: how far over the memory budget a layout is, and what fills it."""
    mem = candidate.memory
    parts = ", ".join(f"{name} {getattr(mem, name) / GIB:.1f}" for name in
                      MEMORY_TERMS if getattr(mem, name))
    return f"needs {mem.total / GIB:.1f} GiB on stage {mem.stage} > {budget / GIB:.1f} GiB usable ({parts} GiB)"


def describe_layout(lay: Layout) -> str:
    d, o = lay.dims, lay.options
    cp = f"{d.cp}" if d.cp == 1 or o.cp_impl == "ring" else f"{d.cp} {o.cp_impl}"
    text = f"dp {d.dp} tp {d.tp} pp {d.pp} cp {cp} ep {d.ep} zero {o.zero} {o.schedule} m {o.microbatches}"
    return text + (f" v {o.virtual_stages}" if o.virtual_stages > 1 else "") + \
        (f" recompute {lay.recompute}" if lay.recompute != "none" else "")


def recipe_words(recipe: Recipe, cluster: Cluster) -> str:
    """What the search assumed beyond the layouts, in words (empty for the defaults)."""
    words = []
    if recipe.fp8:
        words.append(f"the blocks' linear GEMMs in FP8, {recipe.fp8} ({fp8_source(cluster, recipe.fp8)}; "
                     "quantization not charged)")
    if recipe.max_nodes:
        words.append(f"each token's experts on at most {recipe.max_nodes} nodes")
    if recipe.comm_sms:
        words.append(f"the all-to-all's kernels on {recipe.comm_sms} of the {cluster.sms} SMs beside DualPipeV's "
                     "paired compute")
    if recipe.mtp_depth:
        words.append(f"multi-token prediction, {recipe.mtp_depth} module(s) beside the head (each a block, a "
                     "projection, a head pass)")
    return "".join(f"; {w}" for w in words)


def format_plan(plan: Plan, cfg_name: str, cfg: ModelConfig, gpus: int, seq_len: int, global_tokens: int,
                cluster: Cluster, top: int) -> str:
    """The report `python -m minidist.plan` prints."""
    lines = [f"{cfg_name}: {count_params(cfg) / 1e9:.1f}B parameters on {gpus} x {cluster.name} "
             f"({cluster.gpus_per_node} per node, {cluster.memory_bytes / GIB:.0f} GiB, "
             f"{cluster.usable_memory:.0%} usable), {global_tokens:,} tokens per step in sequences of {seq_len}",
             f"compute at {cluster.efficiency:.1%} of the {cluster.peak_flops / 1e12:.0f} TFLOP/s bf16 peak "
             f"({efficiency_source(cluster)}), attention kernels {attention_source(cluster)}, element-wise kernels "
             f"{elementwise_source(cluster)}; links: "
             f"{cluster.intra.name} inside a node, {cluster.inter.name} across; " + precision_words(plan.precision) +
             recipe_words(plan.recipe, cluster),
             f"{len(plan.feasible)} layouts fit, {len(plan.rejected)} do not fit in memory",
             "", f"{'#':>3} {'dp':>5} {'tp':>3} {'pp':>3} {'cp':>3} {'cp by':>9} {'ep':>3} {'zero':>4} "
             f"{'schedule':>11} {'m':>4} {'v':>2} {'recomp':>9} {'GiB':>7} {'at':>3} {'step s':>8} {'compute':>8} "
             f"{'bubble':>6} {'tp':>6} {'cp':>6} {'ep':>6} {'pp':>6} {'dp':>6} {'hidden':>7}"]
    for i, c in enumerate(plan.feasible[:top], 1):
        d, o, t = c.layout.dims, c.layout.options, c.time
        cp_by = o.cp_impl if d.cp > 1 else "-"
        lines.append(f"{i:>3} {d.dp:>5} {d.tp:>3} {d.pp:>3} {d.cp:>3} {cp_by:>9} {d.ep:>3} {o.zero:>4} "
                     f"{o.schedule:>11} {o.microbatches:>4} {o.virtual_stages:>2} {c.layout.recompute:>9} "
                     f"{c.memory.total / GIB:>7.1f} {c.memory.stage:>3} {t.total:>8.3f} {t.compute:>8.3f} "
                     f"{t.bubble:>6.1%} {t.tp:>6.3f} {t.cp:>6.3f} {t.ep:>6.3f} {t.pp:>6.3f} {t.dp:>6.3f} "
                     f"{t.hidden:>7.3f}")
    if not plan.feasible:
        lines.append("  (none fits: more GPUs, a shorter sequence or a smaller batch per replica)")
    lines.append("GiB: per rank on the heaviest pipeline stage ('at'); times in seconds per step; tp, cp, ep, pp, dp "
                 "are exposed communication, hidden is the part that overlaps compute; "
                 "step = (compute + tp + cp + ep + pp) / (1 - bubble) + dp")
    lines.append("not modelled: " + "; ".join(LEFT_OUT))
    faster, seen = [], set()
    for c in plan.rejected:  # the fastest of each grid shape: three different reasons, not one reason thrice
        shape = c.layout.dims
        if shape not in seen and len(faster) < 3:
            seen.add(shape)
            faster.append(plan.heaviest(c))
    if faster:
        lines += ["", "the fastest layouts that do not fit, and why:"]
        lines += [f"  {describe_layout(c.layout)}: {c.time.total:.3f} s, {why_rejected(c, plan.budget)}"
                  for c in faster]
    if plan.refused:
        lines += ["", "not layouts (counted over the grid):"]
        lines += [f"  {reason} ({n}x)" for reason, n in plan.refused.most_common(4)]
    return "\n".join(lines)
