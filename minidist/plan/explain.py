"""One layout in detail (`python -m minidist.plan --explain "dp=128 tp=8 pp=16 cp=1 ep=1"`): its memory on every
pipeline stage and its step time term by term, so a published layout, or a user's own, can be held against the
planner's first choice.

Settings not named are chosen as the search would choose them: the fastest layout of the search that has the
named ones (fitting if one fits). A layout outside the search space (say cp > 1 with selective recomputation, or a
micro-batch count the rules refuse) is evaluated as given, unranked.
"""

from __future__ import annotations

from typing import Any

from minidist.hardware import GIB
from minidist.model.config import ModelConfig
from minidist.parallel.layout import SETTINGS, Layout
from minidist.plan.cluster import Cluster
from minidist.plan.rank_memory import MemoryEstimate, Precision, estimate_memory
from minidist.plan.step_time import DEFAULT_RECIPE, Recipe, StepTime, TokenFlops, attention_shape, predict_step

# What the planner does not model, said with every explanation (each is its own chapter or issue).
LEFT_OUT = ("kernels' efficiency by shape (one bf16 matmul efficiency for every GEMM, or, with --gemm-table, the "
            "blocks' bf16 linears by their shapes' measured rates and the head at that efficiency; FP8 blockwise at "
            "DeepGEMM's rates at DeepSeek-V3's shapes, its routed experts by rows per expert, the other recipes at the "
            "bf16 efficiency of the FP8 peak; FP8's quantization not charged; the attention kernels by key length and "
            "mask only, at head dim 128 whatever the model's)",
            "element-wise kernels beyond one pass each over their inputs and outputs at the datasheet memory bandwidth "
            "(the head's cross-entropy, the router's scores and the optimizer step not charged)",
            "Ulysses context parallelism in the search (--explain cp_impl=ulysses models it; the search tries the ring "
            "and the all-gather)",
            "DualPipe's two parameter copies (its V form, dualpipev, is modelled: only EP's all-to-all and PP's sends "
            "hide in its overlapped pairs)",
            "the routing's imbalance (node-limited routing's two hops are modelled, overlapped as DeepSeek-V3 runs "
            "them)",
            "Llama 3's exact uneven stages (its first and last stage one layer fewer; here the last chunks are the "
            "short ones: the same busiest stage; the trainer interleaves equal chunks only)")


def parse_settings(text: str) -> dict[str, Any]:
    """'dp=128 tp=8 recompute=full' -> {"dp": 128, "tp": 8, "recompute": "full"} (commas or spaces between)."""
    defaults = Layout().flat()  # each setting read as its default's type (a default of None: a whole number)
    out: dict[str, Any] = {}
    for item in text.replace(",", " ").split():
        key, eq, value = item.partition("=")
        if not eq or key not in SETTINGS:
            raise ValueError(f"--explain {item!r} is not SETTING=VALUE with a setting of {', '.join(SETTINGS)}")
        kind = type(defaults[key])
        out[key] = value if kind is str else value.lower() in ("1", "true", "yes") if kind is bool else int(value)
    return out


def stage_table(cfg: ModelConfig, layout: Layout, seq_len: int, micro_batch: int, precision: Precision,
                mtp_depth: int = 0) -> list[str]:
    """One line per pipeline stage: GiB by part and in total, the heaviest marked."""
    rows = [estimate_memory(cfg, layout, seq_len, micro_batch, precision, s, mtp_depth=mtp_depth)
            for s in range(layout.dims.pp)]
    worst = max(range(len(rows)), key=lambda s: rows[s].total)
    share = precision.master / precision.optimizer if precision.optimizer else 0.0  # sharded alike: an exact split
    lines = [f"{'stage':>5} {'params':>7} {'grads':>7} {'master':>7} {'optim':>7} {'acts':>7} {'recomp':>7} "
             f"{'loss':>7} {'gather':>7} {'GiB':>7}"]
    for s, e in enumerate(rows):
        lines.append(f"{s:>5} {e.params / GIB:>7.1f} {e.grads / GIB:>7.1f} {e.optimizer * share / GIB:>7.1f} "
                     f"{e.optimizer * (1 - share) / GIB:>7.1f} {e.activations / GIB:>7.1f} "
                     f"{e.recompute_transient / GIB:>7.1f} {e.loss_transient / GIB:>7.1f} "
                     f"{e.gathered / GIB:>7.1f} {e.total / GIB:>7.1f}"
                     + ("  <- heaviest" if s == worst else ""))
    copies = (f" + {precision.grad_copies:g} of copies + {precision.ddp_bucket:g} of DDP buckets (where replicated), "
              "whole") if precision.grad_copies or precision.ddp_bucket else ""
    lines.append(f"  (grads: {precision.grad:g} bytes per parameter, {precision.grad_buffer}{copies}; master + optim: "
                 f"{precision.master:g} + {precision.optimizer - precision.master:g} bytes per parameter, sharded from "
                 "ZeRO-1; recomp and loss: transients, the larger counted; gather: ZeRO-3's gathered units; "
                 "the stack's reserved GiB come off the usable memory above)")
    return lines


def time_terms(t: StepTime) -> list[str]:
    """The step time as the sum the planner computes, each term in seconds."""
    busy = t.compute + t.tp + t.cp + t.ep + t.pp
    return [f"  compute {t.compute:.3f} + tp {t.tp:.3f} + cp {t.cp:.3f} + ep {t.ep:.3f} + pp {t.pp:.3f} "
            f"= {busy:.3f} s busy per stage (the attention kernels {t.attention:.3f} s of the compute, the "
            f"element-wise ones {t.elementwise:.3f} s)",
            f"  / (1 - bubble {t.bubble:.1%}) = {busy / (1 - t.bubble):.3f} s, + dp exposed {t.dp:.3f} "
            f"= {t.total:.3f} s per step ({t.hidden:.3f} s of communication hidden behind compute)"]


def evaluate(cfg: ModelConfig, layout: Layout, seq_len: int, sequences: int, cluster: Cluster,
             precision: Precision, recipe: Recipe = DEFAULT_RECIPE, per_token: TokenFlops | None = None,
             memo: dict | None = None, time_memo: dict | None = None) -> tuple[MemoryEstimate, StepTime, bool]:
    """One layout, in the search or outside it: (memory of its heaviest stage, step time, whether it fits); a
    search passes its `token_flops` and its memo dicts (`estimate_memory`'s, `predict_step`'s)."""
    micro_batch = sequences // (layout.dims.dp * layout.options.microbatches)
    memory = estimate_memory(cfg, layout, seq_len, micro_batch, precision, memo=memo, mtp_depth=recipe.mtp_depth)
    time = predict_step(cfg, layout, seq_len, sequences, cluster, precision, per_token, recipe, time_memo)
    return memory, time, memory.total <= cluster.budget


def format_explain(cfg: ModelConfig, layout: Layout, described: str, time: StepTime, fits: bool, rank: int | None,
                   n_feasible: int, seq_len: int, sequences: int, precision: Precision, budget: float,
                   mtp_depth: int = 0) -> str:
    """The --explain report: the layout (`described` in words), its place, memory per stage, time by term."""
    micro_batch = sequences // (layout.dims.dp * layout.options.microbatches)
    place = f"rank {rank} of {n_feasible} that fit" if rank else \
        ("does not fit" if not fits else "outside the search space")
    lines = [f"{described}: {time.total:.3f} s per step, {place}",
             f"memory per rank by pipeline stage (GiB; {budget / GIB:.1f} usable), micro-batch of {micro_batch} "
             f"sequences:"]
    lines += stage_table(cfg, layout, seq_len, micro_batch, precision, mtp_depth)
    key_len, causal = attention_shape(layout, seq_len)
    lines += ["step time:"] + time_terms(time)
    lines += [f"  the attention kernels: queries meet up to {key_len:,} keys per kernel, {causal:.0%} of their work "
              "under the causal mask" + (" (the rest whole tiles)" if causal < 1 else "")]
    if time.linear_rate:
        lines += [f"  the blocks' linears: {time.linear_rate / 1e12:,.1f} TFLOP/s by their shapes' measured rates"
                  + (f" ({time.unmeasured} shapes outside the table, at the efficiency)" if time.unmeasured else "")]
    lines += ["not modelled: " + "; ".join(LEFT_OUT)]
    return "\n".join(lines)
