"""Predicted step time of a layout (chapter 12): compute from FLOPs, communication from the α-β model per
dimension, the pipeline bubble, and which communication hides behind compute.

* Compute: the model FLOPs of a step (`flops.mfu_flops_per_token`: 6·N_active + causal attention; full
  recomputation adds one more forward of the blocks; selective adds no matmul) split over the ranks, the blocks' at
  the pace of the pipeline stage with the most of them, at `Cluster.efficiency` of the chip's dense peak (by default
  the chip's published best matmul throughput, `hardware.MATMUL_EFFICIENCY`), but the attention kernels' (scores
  and values): at a measured attention kernel's rate for the keys each query meets (`Cluster.attention_kernel`,
  `hardware.ATTENTION_KERNEL`: FlashAttention-2's forward + backward on the chip; the sequence, or its 1/cp chunk
  under ring context parallelism; with the causal mask, but for context parallelism's whole blocks off the
  diagonal), in that benchmark's count of the kernels' work (a backward of 2.5 forwards: the scores recomputed).
  MoE layers run whole on every tp rank (as in the trainer), so their FLOPs are not divided by tp. The element-wise
  kernels between the matmuls: one pass each over their values at the chip's memory bandwidth (`plan.elementwise`).
* Communication, per rank and step, each collective by `hardware.collective_time` (α·steps + β·bytes) over the link
  its group crosses, on the pipeline rank with the most blocks (`busiest_stage_kinds`). The grid is (pp, dp, cp,
  tp), tp fastest (`topology`): a group of dimension d spans the ranks up to its last member, tp for tp, tp·cp for
  cp, tp·ep for ep, tp·cp·dp for dp; NVLink when that span fits a node, the network (one port per GPU) when not
  (`hardware.link_of`).
    tp   2 all-reduces (sequence parallel: reduce-scatter + all-gather, the same bytes) per dense block forward,
         2 backward, 2 more when the forward is recomputed; one region in an MoE block (attention)   exposed
    cp   what chapter 10's kernels send per block (`cp.traffic.expected_cp_traffic`, the formula their ledger
         equals): the ring's sends overlapped with the attention kernels, only the excess exposed; all-gather (as
         Llama 3 runs it) and Ulysses: their collectives, exposed (`context_parallel_time`)
    ep   dispatch + combine all-to-all per MoE block, forward and backward (+ forward again if recomputed)  exposed
    pp   one activation per micro-batch and chunk boundary forward, one gradient backward               exposed
    dp   gradients over dp·cp (dense) and edp (experts), ZeRO's collectives (`zero_bytes.zero_comm_bytes`):
         the reduction overlaps the backward it follows (the last micro-batch's, every one's from ZeRO-2),
         ZeRO-3's parameter gathers overlap the compute; the parameter all-gather after the step is exposed
* Pipeline: the exposed per-micro-batch work stretches by the bubble, busy / (1 − bubble), with
  `schedule_costs.pipeline_bubble` ((p−1)/(m+p−1); interleaved (p−1)/(v·m+p−1); ZB-H1, ZB-V and DualPipeV for the
  stage's T_F : T_B : T_W). The V schedules place two chunks per rank (the embedding and the head on rank 0,
  `stages.placement`). DualPipeV's overlapped (F, B) pairs (`schedule_costs.paired_share` of the forwards)
  hide the pipeline sends and the ep all-to-all behind the paired chunk's compute, each pair max(compute,
  communication) (DeepSeek-AI 2024, §3.2.1).
* DeepSeek-V3's kernels (`Precision.fp8_saved`, `plan.deepseek_saves`) without further recomputation: MLA's
  up-projections' GEMMs once more forward, the norms', RoPE's and SwiGLU's element-wise forwards again.
* `Recipe`: FP8 GEMMs in the blocks' linears (`fp8_rate`: blockwise at DeepGEMM's rate measured at DeepSeek-V3's
  shapes on H800, else the FP8 peak at the bf16 efficiency; the forward's dispatch in FP8);
  node-limited routing (at most M nodes per token: min(top_k, M) rows per token over the network, an all-to-all
  among the nodes, top_k over NVLink, the two hops at once: the slower counts, `expert_all_to_all`); the
  all-to-all's kernels on `comm_sms` SMs, beside DualPipeV's paired compute, which runs on the rest.

    step = (compute + tp + cp exposed + ep + pp) / (1 − bubble) + dp exposed

Left out: the head's imbalance (on the last stage), the matmuls' efficiency by shape (but FP8's on H800/H100),
element-wise kernels beyond one pass each, FP8's quantization, the network's congestion and topology beyond one port
per GPU, the routing's imbalance, optimizer time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from minidist.flops import _is_moe_layer, _moe_mlp, attention_flops_per_token, mfu_flops_per_token
from minidist.hardware import ATTENTION_KERNEL_FLOPS, attention_rate, collective_time, ledger_time, link_of
from minidist.model.config import ModelConfig
from minidist.parallel.cp.core import LAYOUT_OF
from minidist.parallel.cp.sharding import chunks_per_rank as sequence_chunks
from minidist.parallel.cp.traffic import expected_cp_traffic
from minidist.parallel.layout import Layout
from minidist.parallel.pp.zero_bubble import chunks_per_rank
from minidist.plan import deepseek_saves, gemm_table, mtp
from minidist.plan.cluster import Cluster, fp8_rate
from minidist.plan.elementwise import elementwise_seconds
from minidist.plan.rank_memory import Precision, alternate_recomputed_flops_per_token, memoized, rank_params
from minidist.plan.schedule_costs import paired_share, pipeline_bubble, split_costs
from minidist.plan.stages import busiest_stage_kinds


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on one rank, by part; `total` is the prediction."""

    compute: float
    bubble: float  # the idle fraction of the pipelined part
    tp: float
    cp: float  # exposed
    ep: float
    pp: float
    dp: float  # exposed
    hidden: float  # communication overlapped with compute (not in total)
    attention: float = 0.0  # of `compute`: the attention kernels' seconds
    elementwise: float = 0.0  # of `compute`: the element-wise kernels' (`plan.elementwise`)
    linear_rate: float = 0.0  # FLOP/s of the blocks' bf16 linears from a measured GEMM table (0: none)
    unmeasured: int = 0  # of their GEMM shapes, those outside the table (at the cluster's efficiency)

    @property
    def total(self) -> float:
        return (self.compute + self.tp + self.cp + self.ep + self.pp) / (1 - self.bubble) + self.dp


@dataclass(frozen=True)
class TokenFlops:
    """Training FLOPs per token of a model at one sequence length: all of them, the MoE layers', the head's, and
    the attention scores' and values' (causal)."""

    total: float
    moe: float
    head: float
    attention: float


def token_flops(cfg: ModelConfig, seq_len: int, mtp_depth: int = 0) -> TokenFlops:
    """`cfg`'s FLOPs per token; `mtp_depth`: with multi-token prediction's projections and head passes, counted
    with the head (`cfg` counts its blocks, `plan.mtp`)."""
    moe_layers = sum(_is_moe_layer(cfg, i) for i in range(cfg.n_layers))
    heads = mtp.head_flops_per_token(cfg, mtp_depth)
    return TokenFlops(mfu_flops_per_token(cfg, seq_len) + heads,
                      6.0 * moe_layers * _moe_mlp(cfg, active_only=True) if moe_layers else 0.0,
                      6.0 * cfg.d_model * cfg.vocab_size + heads, attention_flops_per_token(cfg, seq_len, causal=True))


@dataclass(frozen=True)
class RankFlops:
    """FLOPs one rank computes per step: all of them, the attention kernel's, and the blocks' linear layers'
    (the GEMMs an FP8 recipe runs in FP8: not the embedding, the head, the router or the attention kernel)."""

    total: float
    attention: float
    linears: float
    experts: float = 0.0  # the routed experts' share of `linears` (grouped GEMMs, their rate by rows per expert)
    attention_kernel: float = 0.0  # the attention kernels' work in their benchmark's count (`ATTENTION_KERNEL_FLOPS`)


def step_flops_per_rank(cfg: ModelConfig, layout: Layout, seq_len: int, global_batch: int,
                        per_token: TokenFlops | None = None) -> RankFlops:
    """The step's model FLOPs (plus the recomputed forward) over the ranks; MoE layers' FLOPs are repeated on every
    tp rank."""
    f = per_token or token_flops(cfg, seq_len)  # `predict_step` passes the recipe's
    total, moe, attention = f.total, f.moe, f.attention
    forwards = 3  # the attention FLOPs count a forward and a backward of two
    if layout.recompute == "full":
        forwards = 4
        total += (total - f.head) / 3  # one more forward of the blocks: a third of their training FLOPs
        moe *= 4 / 3
        attention *= 4 / 3
    dims, o = layout.dims, layout.options
    # the pipeline runs at the pace of the stage with the most blocks (126 layers over 16 stages: 8, not 7.875)
    imbalance = sum(busiest_stage_kinds(cfg, dims.pp, o.virtual_stages, o.schedule)) * dims.pp / cfg.n_layers
    blocks = total - f.head
    total, moe, attention = f.head + blocks * imbalance, moe * imbalance, attention * imbalance
    split = (total - moe) / dims.tp + moe
    tokens = global_batch * seq_len / (dims.dp * dims.cp * dims.pp)  # one pipeline stage's share of a replica
    linears = split - f.head / dims.tp - attention / dims.tp
    attention = attention / dims.tp * tokens
    kernel = attention / forwards * (ATTENTION_KERNEL_FLOPS + forwards - 3)  # the backward at 2.5 forwards, not 2
    return RankFlops(split * tokens, attention, linears * tokens, moe * _routed_share(cfg) * tokens, kernel)


def _routed_share(cfg: ModelConfig) -> float:
    """The routed experts' part of an MoE layer's FLOPs per token (the rest: the router, the shared experts)."""
    if not cfg.moe.n_experts:
        return 0.0
    return 3 * cfg.d_model * (cfg.moe.d_expert or cfg.d_ff) * cfg.moe.top_k / _moe_mlp(cfg, active_only=True)


def compute_seconds(flops: RankFlops, cluster: Cluster, attention: float, fp8: str = "",
                    rows_per_expert: float = 0.0, linear_rate: float | None = None) -> float:
    """Seconds of compute: every FLOP at the cluster's matmul efficiency of the bf16 peak but the attention kernels'
    (their `attention` seconds, from `attention_seconds`) and the blocks' linears: in bf16 at `linear_rate` when
    given (their shapes' measured rates, `layout_linear_rate`); under FP8 (`fp8` a recipe's name) at `fp8_rate`,
    the routed experts' at their rate for `rows_per_expert`. The FP8 recipe's quantization (casts and scales,
    element-wise passes over the linears' inputs and gradients) is not charged: fused into the GEMMs' neighbours in
    DeepSeek-V3's kernels, and small against the GEMMs at these sizes."""
    rate = cluster.peak_flops * cluster.efficiency
    seconds = (flops.total - flops.attention - flops.linears) / rate + attention
    if not fp8:
        return seconds + flops.linears / (linear_rate or rate)
    return (seconds + (flops.linears - flops.experts) / fp8_rate(cluster, fp8)
            + flops.experts / fp8_rate(cluster, fp8, rows_per_expert))


def layout_linear_rate(cfg: ModelConfig, layout: Layout, cluster: Cluster, tokens: int, rows_per_expert: float,
                       kinds: tuple[int, int]) -> tuple[float | None, int]:
    """(FLOP/s of the busiest stage's linears in bf16 from the cluster's measured GEMM table, or None without one;
    how many of their shapes the table does not cover): `tokens` rows per micro-batch, `kinds` its (dense, MoE)
    layers (`gemm_table.linear_rate`)."""
    if cluster.gemm_table is None:
        return None, 0
    dims = layout.dims
    per_layer = gemm_table.layer_gemms(cfg, dims.tp, tokens, rows_per_expert, dims.ep)
    forward = [(shape, count * layers) for kind, layers in zip(("dense", "moe"), kinds, strict=True)
               for shape, count in per_layer[kind]]
    gemms = gemm_table.training_gemms(forward, 2 if layout.recompute == "full" else 1)
    return gemm_table.linear_rate(cluster.gemm_table, gemms, cluster.peak_flops * cluster.efficiency)


def attention_seconds(flops: RankFlops, cluster: Cluster, key_len: float, causal_share: float = 1.0) -> float:
    """Seconds of the attention kernels whose queries meet up to `key_len` keys: their work at the cluster's measured
    attention kernel's rates for that length, `causal_share` of it at the causal mask's and the rest at whole
    tiles' (context parallelism's blocks off the diagonal), or their FLOPs at the matmul rate where none was
    measured."""
    kernel = cluster.attention_kernel
    if kernel is None:
        return flops.attention / (cluster.peak_flops * cluster.efficiency)
    per_flop = causal_share / attention_rate(kernel.causal, key_len)
    if causal_share < 1:
        per_flop += (1 - causal_share) / attention_rate(kernel.full, key_len)
    return flops.attention_kernel * per_flop


@dataclass(frozen=True)
class Recipe:
    """How the run computes and routes, beyond the layout: `fp8` names the trainer's --fp8 recipe the blocks' linear
    GEMMs run in ('tensorwise', 'rowwise', 'blockwise': DeepSeek-V3's §3.3; '' for bf16); `max_nodes` > 0 limits
    each token's experts to that many nodes (DeepSeek-V3's node-limited routing, M = 4; the trainer's router does
    not limit them: 0); `comm_sms` > 0 SMs run the expert all-to-all's kernels beside DualPipeV's paired compute,
    which has the rest (DeepSeek-V3 §3.2.2 and §3.5.1: 20 of the H800's 132, "which will limit the computational
    throughput"; the trainer's NCCL collectives: 0, not charged); `mtp_depth` multi-token prediction's modules
    (`plan.mtp`, DeepSeek-V3 §2.2: 1; the trainer: 0)."""

    fp8: str = ""
    max_nodes: int = 0
    comm_sms: int = 0
    mtp_depth: int = 0  # multi-token prediction's modules (DeepSeek-V3 §2.2: 1; `plan.mtp`); the trainer has none


DEFAULT_RECIPE = Recipe()  # bf16 GEMMs, routing unlimited: the trainer's defaults


def check_comm_sms(comm_sms: int, cluster: Cluster) -> None:
    """A one-line ValueError unless `comm_sms` SMs leave some of the cluster's chip to compute."""
    if not 0 <= comm_sms < (cluster.sms or 1):
        fits = f"0 <= N < {cluster.sms}" if cluster.sms else "0 (no SM count to take them from)"
        raise ValueError(f"--comm-sms {comm_sms}: {cluster.name} has {cluster.sms or 'no'} SMs on record; "
                         f"choose {fits}")


def predict_step(cfg: ModelConfig, layout: Layout, seq_len: int, global_batch: int, cluster: Cluster,
                 precision: Precision, per_token: TokenFlops | None = None,
                 recipe: Recipe = DEFAULT_RECIPE, memo: dict | None = None) -> StepTime:
    """Predicted step time of `layout` (global_batch sequences of seq_len tokens) on `cluster` (`memo`: a search's
    dict for one model, cluster, precision and recipe: all but the replica groups' terms are the same for every
    ZeRO stage, computed once)."""
    check_comm_sms(recipe.comm_sms, cluster)
    o = layout.options
    key = ("stage", layout.dims, o.schedule, o.microbatches, o.virtual_stages, o.cp_impl, layout.sp_degree,
           layout.recompute)
    stage = memoized(memo, key, lambda: _stage_time(cfg, layout, seq_len, global_batch, cluster, precision,
                                                    per_token, recipe))
    dp_exposed, dp_hidden = _data_parallel_time(cfg, layout, cluster, precision, stage.compute, memo,
                                                recipe.mtp_depth)
    return dataclasses.replace(stage, dp=dp_exposed, hidden=stage.hidden + dp_hidden)


def _stage_time(cfg: ModelConfig, layout: Layout, seq_len: int, global_batch: int, cluster: Cluster,
                precision: Precision, per_token: TokenFlops | None, recipe: Recipe) -> StepTime:
    """Every term of `predict_step` but the replica groups' (dp 0)."""
    per_token = per_token or token_flops(cfg, seq_len, recipe.mtp_depth)
    replayed = precision.fp8_saved and layout.recompute == "none"  # DeepSeek-V3's kernels recompute a few parts
    if replayed:  # their GEMMs: MLA's up-projections' forward, again in the backward (`deepseek_saves`)
        per_token = dataclasses.replace(per_token,
                                        total=per_token.total + deepseek_saves.recomputed_flops_per_token(cfg))
    if layout.recompute == "selective" and precision.selective == "alternate_matmuls":  # torchtitan's policy
        per_token = dataclasses.replace(per_token, total=per_token.total + alternate_recomputed_flops_per_token(cfg))
    flops = step_flops_per_rank(cfg, layout, seq_len, global_batch, per_token)
    dims, o = layout.dims, layout.options
    m, p = o.microbatches, precision.activation
    v = chunks_per_rank(o.schedule, o.virtual_stages)
    b = global_batch // (dims.dp * m)  # sequences per micro-batch
    tokens = b * seq_len // dims.cp  # per rank and micro-batch
    # each expert gets its share of the top-k rows of the ep ranks' tokens (balanced routing)
    rows_per_expert = tokens * cfg.moe.top_k * dims.ep / cfg.moe.n_experts if cfg.moe.n_experts else 0.0
    key_len, causal = attention_shape(layout, seq_len)
    attention = attention_seconds(flops, cluster, key_len, causal)
    dense_layers, moe_layers = busiest_stage_kinds(cfg, dims.pp, o.virtual_stages, o.schedule)
    elementwise = elementwise_seconds(cfg, layout, m * tokens, (dense_layers, moe_layers), p, cluster.hbm_bandwidth,
                                      replayed)
    linear_rate, unmeasured = layout_linear_rate(cfg, layout, cluster, tokens, rows_per_expert,
                                                 (dense_layers, moe_layers))
    compute = compute_seconds(flops, cluster, attention, recipe.fp8, rows_per_expert, linear_rate) + elementwise
    # full recomputation runs each block's forward again; selective replays its element-wise operators and the
    # collectives between them (tp's reductions, cp's ring, ep's all-to-alls), not its matmuls
    again = 0 if layout.recompute == "none" else 1

    act = tokens * cfg.d_model * p
    tp = 0.0
    if dims.tp > 1:
        calls = (2 * dense_layers + moe_layers) * (2 + again)
        tp = m * calls * collective_time("all_reduce", act, dims.tp, link_of(cluster, dims.tp))
    cp_exposed, cp_hidden = context_parallel_time(cfg, layout, cluster, b, seq_len, p, (dense_layers, moe_layers),
                                                  attention)
    ep = 0.0
    if dims.ep > 1 and moe_layers:
        # dispatch + combine forward, their gradients backward (+ the forward's again when recomputed); an FP8
        # recipe dispatches the forward's rows in FP8 (DeepSeek-V3 §3.3.4: one byte a value, half of bf16's)
        calls = 4 + 2 * again - (0.5 * (1 + again) if recipe.fp8 else 0.0)
        ep = m * moe_layers * calls * expert_all_to_all(cfg, tokens, layout, cluster, p, recipe.max_nodes)
    pp = 0.0
    if dims.pp > 1:
        span = 2 * dims.tp * dims.cp * dims.dp
        pp = 2 * m * v * collective_time("send", act / layout.sp_degree, 2, link_of(cluster, span))
    # DualPipeV: in its overlapped (F, B) pairs one's all-to-all and sends hide behind the other's compute, each
    # pair taking max(compute, communication) instead of their sum
    paired = paired_share(o.schedule, dims.pp, m)
    if recipe.comm_sms and ep:  # the paired chunks compute on the SMs the all-to-all's kernels leave them
        compute *= 1 + paired * recipe.comm_sms / (cluster.sms - recipe.comm_sms)
    overlap = min(paired * (ep + pp), paired * compute)
    costs = split_costs(flops.attention / flops.total, layout.recompute)
    bubble = pipeline_bubble(o.schedule, dims.pp, m, o.virtual_stages, costs)
    share = overlap / (ep + pp) if overlap else 0.0
    return StepTime(compute, bubble, tp, cp_exposed, ep * (1 - share), pp * (1 - share), 0.0, cp_hidden + overlap,
                    attention, elementwise, linear_rate or 0.0, unmeasured)


def attention_shape(layout: Layout, seq_len: int) -> tuple[int, float]:
    """(keys each query meets in one attention kernel, the share of the kernels' work under the causal mask): a ring
    step's chunk, else the whole sequence (all-gather, Ulysses); the ring and the all-gather split each sequence
    into n·cp chunks as the trainer does (`cp.core.LAYOUT_OF`: zigzag, n = 2), and of a rank's blocks of queries
    and keys only the n diagonal ones are causal, 1/(n·cp) of the work, the others whole tiles; Ulysses attends
    whole sequences (of its heads) under the causal mask. The lengths are those of the fused context-parallel
    kernels large runs use (a ring step over this rank's T/cp keys, the all-gather's queries over all T keys); this
    trainer's CPU-first blockwise kernel runs one chunk pair, T/(2·cp) keys, per call."""
    dims, impl = layout.dims, layout.options.cp_impl
    key_len = seq_len // dims.cp if impl == "ring" else seq_len
    if dims.cp == 1 or impl == "ulysses":
        return key_len, 1.0
    return key_len, 1 / (sequence_chunks(LAYOUT_OF[impl]) * dims.cp)


def context_parallel_time(cfg: ModelConfig, layout: Layout, cluster: Cluster, sequences: int, seq_len: int, p: int,
                          kinds: tuple[int, int], attention: float) -> tuple[float, float]:
    """(exposed, hidden) seconds of context parallelism's traffic per step on the busiest pipeline rank: what
    chapter 10's kernels send (`cp.traffic.expected_cp_traffic`, the ledger a run must equal, each block's forward
    again under recomputation) for each micro-batch of `sequences` sequences of `seq_len` tokens through the rank's
    `kinds` (dense, MoE) blocks, elements of `p` bytes, by the α-β model on the link the cp group spans. The ring's
    sends overlap the attention kernels (`attention` seconds) and are exposed beyond them; the all-gather's
    collectives (as Llama 3 runs it, §3.3.2: "the all-gather communication latency is exposed in the critical
    path"), Ulysses' all-to-alls and the MoE blocks' all-reduce of routing counts are exposed."""
    dims = layout.dims
    if dims.cp == 1:
        return 0.0, 0.0
    dense, moe = kinds
    first_moe = cfg.moe.first_dense_layers
    layers = [*range(dense), *range(first_moe, first_moe + moe)]  # the rank's blocks as the ledger counts them
    traffic = expected_cp_traffic(cfg, layout.options.cp_impl, sequences, seq_len, dims.cp, dims.tp, layers,
                                  element_size=p, recomputed=layout.recompute != "none")
    link, m = link_of(cluster, dims.tp * dims.cp), layout.options.microbatches
    ring = m * ledger_time({key: e for key, e in traffic.items() if key[0] == "send"}, dims.cp, link)
    exposed = m * ledger_time({key: e for key, e in traffic.items() if key[0] != "send"}, dims.cp, link)
    hidden = min(ring, attention)
    return exposed + ring - hidden, hidden


def expert_all_to_all(cfg: ModelConfig, tokens: int, layout: Layout, cluster: Cluster, p: int,
                      max_nodes: int = 0) -> float:
    """Seconds of one all-to-all (dispatch or combine) of `tokens` tokens' top-k rows over the ep group, on the link
    the group spans. Node-limited routing (`max_nodes` > 0; DeepSeek-V3 §2.1.2 and §3.2.2: each token's experts on
    at most M nodes, a row crossing the network once per node and forwarded over NVLink to the experts there)
    sends min(top_k, M, nodes) rows per token across the network, to the GPU of the same index on each target node
    (an all-to-all among the nodes), and the top_k over NVLink inside the node; the two
    hops run at once (§3.2.2: chunks forwarded over NVLink while the next cross the network, "IB and NVLink fully
    overlapped"), so the all-to-all takes the longer of the two, not their sum."""
    dims, k = layout.dims, cfg.moe.top_k
    rows = tokens * k * cfg.d_model * p
    link = link_of(cluster, dims.tp * dims.ep)
    nodes = -(-dims.tp * dims.ep // cluster.gpus_per_node)
    if nodes == 1 or not max_nodes:
        return collective_time("all_to_all", rows, dims.ep, link)
    # the network hop is an all-to-all among the nodes (a row goes to the GPU of the same index on each target
    # node, §3.2.2); a token's own node, when among its M, is reached over NVLink alone
    inter = collective_time("all_to_all", rows * min(k, max_nodes, nodes) / k, nodes, link)
    intra = collective_time("all_to_all", rows, cluster.gpus_per_node, link_of(cluster, cluster.gpus_per_node))
    return max(inter, intra)


def _data_parallel_time(cfg: ModelConfig, layout: Layout, cluster: Cluster, precision: Precision,
                        compute: float, memo: dict | None = None, mtp_depth: int = 0) -> tuple[float, float]:
    """(exposed, hidden) seconds of the gradient reduction and ZeRO's gathers over the replica groups (`memo`: a
    search's dict for one model, precision and cluster: each collective computed once per grid shape)."""
    o = layout.options
    key = ("dp", layout.dims, o.schedule, o.virtual_stages)
    all_reduce, reduce_scatter, all_gather = memoized(memo, key,
                                                      lambda: _replica_collectives(cfg, layout, cluster, precision,
                                                                                   mtp_depth))
    m, backward, zero = o.microbatches, 2 * compute / 3, o.zero
    exposed = 0.0 if zero == 0 else all_gather  # ZeRO 1-2: the updated parameters gathered after the step
    overlappable = all_reduce if zero == 0 else reduce_scatter * (m if zero >= 2 else 1)
    if zero == 3:
        exposed, overlappable = 0.0, overlappable + 2 * m * all_gather  # gathered for every forward and backward
    window = compute if zero == 3 else backward if zero == 2 else backward / m
    hidden = min(overlappable, window)
    return exposed + overlappable - hidden, hidden


def _replica_collectives(cfg: ModelConfig, layout: Layout, cluster: Cluster, precision: Precision,
                         mtp_depth: int = 0) -> tuple[float, float, float]:
    """Seconds of one gradient all-reduce, one gradient reduce-scatter and one parameter all-gather over the
    replica groups (dense over dp·cp, experts over edp), summed over the groups."""
    span = layout.dims.tp * layout.dims.cp * layout.dims.dp
    link = link_of(cluster, span)
    out = [0.0, 0.0, 0.0]
    for kind, n in rank_params(cfg, layout, 0, mtp_depth).items():
        size = layout.replicas[kind]
        if size == 1 or n == 0:
            continue
        out[0] += collective_time("all_reduce", n * precision.grad, size, link)
        out[1] += collective_time("reduce_scatter", n * precision.grad, size, link)
        out[2] += collective_time("all_gather", n * precision.param, size, link)
    return out[0], out[1], out[2]
