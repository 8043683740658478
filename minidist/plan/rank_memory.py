"""The memory model per rank: bytes of parameters, gradients, optimizer state and activations for any model and
layout, from the formulas the chapters derived (chapter 12; checked against `memory_measure` on the CPU).

* Parameters per rank (`rank_params`): chapter 08's shards (attention heads, the feed-forward, the vocabulary split
  over tp; norms and MLA's latent down-projections replicated; MoE layers whole on every tp rank, as the trainer
  runs them), chapter 09's stages (`pipeline.chunk_layers`; the embedding on the first stage, the final norm and
  the head on the last), chapter 11's expert blocks (n_experts / ep per rank).
* Model states (Rajbhandari et al. 2020, "ZeRO", §5): P + G + K bytes per parameter (`Precision`), the optimizer
  state sharded over the replicas from stage 1, gradients from stage 2, parameters at stage 3. Dense parameters
  are replicated over dp·cp, expert blocks over edp = dp·cp / ep (chapter 11).
* Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4-5):
  `memory.activation_bytes_per_layer` for the course's Llama block, per micro-batch of b sequences and
  s/cp tokens each (chapter 10), the attention and feed-forward tensors divided by tp, the norms too under
  sequence parallelism (whose column-parallel linears then save their gathered input); MoE and MLA layers tensor
  by tensor below; the head: the final norm, the log-softmax of the (vocab-split) logits. Under full recomputation
  (Chen et al. 2016) a block keeps only its input; the one block being recomputed is `recompute_transient`; under
  selective recomputation (`train.blocks.keep_matmuls`) its input and its matmul and attention outputs. A
  pipeline rank holds the chunk-forwards its schedule keeps in flight at the worst moment, and its blocks where the
  schedule places them (`stages`: p − r micro-batches for 1F1B, m for AFAB, until W under chapter 15's schedules;
  under ZB-V and DualPipeV rank 0 holds the embedding and the head). `Precision.fused` / `sp_regather`:
  Megatron-LM's kernels' saved tensors in place of this trainer's (`BF16_MEGATRON`); `fp8_saved`: DeepSeek-V3's
  (`deepseek_saves`). Multi-token prediction's projections and second head pass on the head's rank (`mtp`).

Left out (small, or not a function of the shapes; a stack's `reserved_gib` stands for them): step counters, ZeRO's
padding, communication buffers, the allocator's fragmentation, CUDA/NCCL workspaces, RoPE tables, routed tokens'
imbalance, a backward's temporaries. Checked within `TOLERANCE` of bytes measured on the CPU (test_memory_estimate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from minidist import memory
from minidist.flops import _attention_weights, _dense_mlp, _is_moe_layer
from minidist.model.config import ModelConfig
from minidist.parallel.cp.core import kv_heads_per_rank
from minidist.parallel.cp.traffic import gathered_kv_bytes
from minidist.parallel.layout import Layout
from minidist.parallel.pp.zero_bubble import chunks_per_rank
from minidist.plan import deepseek_saves, mtp
from minidist.plan.stages import chunks_in_flight, first_moe_layer, head_stage, placement, stage_kinds

T = TypeVar("T")

TOLERANCE = 0.05  # relative, per part (params, grads, optimizer, activations), against measured bytes on the CPU


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of the weights, gradients and optimizer state (master copy included), per activation
    element, and per element of the residual stream between blocks."""

    param: int
    grad: int
    optimizer: int
    activation: int
    residual: int
    # What the kernels keep, where implementations differ (`layer_activation_bytes`): False, False is this trainer
    fused: bool = False  # fused RMSNorm, RoPE and SwiGLU kernels keep only their inputs (and RMSNorm's 1/rms)
    sp_regather: bool = False  # an SP column-parallel linear keeps its input sharded, gathers it again backward
    fp8_saved: bool = False  # DeepSeek-V3's: FP8 copies, norms and MLA's up-projections recomputed (`deepseek_saves`)
    master: float = 0  # of `optimizer`, the bytes of the fp32 master copy (shown apart; sharded alike)
    grad_buffer: str = "sharded"  # "full": `grad` bytes for every parameter of the rank whatever the ZeRO stage
    fused_norm: bool | None = None  # None: as `fused`; a stack may pair a fused RMSNorm with eager RoPE and SwiGLU
    fused_loss: bool | None = None  # None: as `fused` (`loss_transient_bytes`)
    selective: str = "matmuls"  # what `--recompute selective` keeps (`SELECTIVE_POLICIES`)
    grad_copies: float = 0  # bytes per parameter of gradients kept whole beside `grad` until the step (autograd's)
    ddp_bucket: float = 0  # bytes per replicated parameter of torch DDP's flat buckets (not views of the gradients)


# The trainer on a CPU: fp32 everywhere, AdamW's two moments (the parameters are the master copy).
FP32 = Precision(param=4, grad=4, optimizer=8, activation=4, residual=4)
# Mixed precision as in ZeRO §3.1 and Megatron-LM: bf16 weights and gradients, fp32 master copy and moments.
BF16_MIXED = Precision(param=2, grad=2, optimizer=12, activation=2, residual=2, master=4)
# The same with Megatron-LM's kernels, as the published large runs use them (Korthikanti et al. 2022, §4.2.2: with
# sequence parallelism every saved activation of a block is split over tp): a fused RMSNorm that keeps its bf16
# input and 1/rms; RoPE applied inside a fused kernel that keeps nothing (q and k kept once, as the attention's
# inputs); a fused SwiGLU that keeps its input [x·W1, x·W3] and recomputes the SiLU and the product backward (the
# second linear keeps its own input: 3 of the trainer's 4 tensors of the feed-forward's width); sequence-parallel
# linears that keep their input sharded and all-gather it again in the backward
# (`LinearWithGradAccumulationAndAsyncCommunication`, overlapped with the input-gradient GEMM: not charged).
BF16_MEGATRON = Precision(2, 2, 12, 2, 2, fused=True, sp_regather=True, master=4, selective="core_attention")
# DeepSeek-V3's stack (DeepSeek-AI 2024, §3.3.3): the AdamW moments in BF16, the master weights and the gradients
# (accumulated over the micro-batches) kept in FP32: 4 + 2 + 2 bytes of optimizer state, 4 of gradient; its kernels'
# activations (`deepseek_saves`: FP8 copies, §3.3.2; norms and MLA's up-projections recomputed, §3.2.3), Megatron-LM's
# under full recomputation (each block's input).
BF16_DEEPSEEK = Precision(2, 4, 8, 2, 2, fused=True, sp_regather=True, fp8_saved=True, master=4,
                          selective="core_attention")
PRECISIONS = {"trainer": BF16_MIXED, "megatron": BF16_MEGATRON, "deepseek": BF16_DEEPSEEK}  # the planner's --kernels


def precision_words(precision: Precision) -> str:
    """The bytes per parameter a precision keeps, and whose kernels' activations when not this trainer's, in words
    (the planner's report)."""
    names = {2: "bf16", 4: "fp32"}
    return (f"{names.get(precision.param, precision.param)} weights, {names.get(precision.grad, precision.grad)} "
            f"gradients, {precision.optimizer} bytes per parameter of master copy and AdamW moments" +
            ("; DeepSeek-V3's kernels' activations (FP8 copies; norms, SwiGLU and MLA's up-projections recomputed)"
             if precision.fp8_saved else "; Megatron-LM's kernels' activations" if precision.fused else ""))


# What a stack's selective recomputation keeps of a block: "matmuls", this trainer's (`train.blocks.keep_matmuls`,
# every matmul's and the attention kernel's output); "alternate_matmuls", torchtitan's op-level policy (the outputs
# of a block's 1st, 3rd, 5th, ... `aten.mm` and of SDPA: every second matmul recomputed); "core_attention",
# Megatron-LM's (Korthikanti et al. 2022, §5: only the attention core recomputed, which under FlashAttention keeps
# what its backward needs anyway: the bytes of no recomputation).
SELECTIVE_POLICIES = ("matmuls", "alternate_matmuls", "core_attention")


# MemoryEstimate's byte terms, in its order (`--json --all`'s overflow_term is the largest of them)
MEMORY_TERMS = ("params", "grads", "optimizer", "activations", "recompute_transient", "loss_transient", "gathered")


@dataclass(frozen=True)
class MemoryEstimate:
    params: float
    grads: float
    optimizer: float
    activations: float
    recompute_transient: float = 0.0  # the block recomputed in the backward (full recompute), on top of the rest
    stage: int = 0  # the pipeline rank these bytes are for (the heaviest, when the estimate is for a layout)
    loss_transient: float = 0.0  # the loss's logits and their gradient beyond the saved softmax (the head's rank)
    gathered: float = 0.0  # ZeRO-3's gathered units and one unit's unsharded gradients (`zero3_gathered_bytes`)

    @property
    def total(self) -> float:
        # the loss's transient is gone before the first block's backward recomputes it: the larger of the two
        return self.params + self.grads + self.optimizer + self.activations + \
            max(self.recompute_transient, self.loss_transient) + self.gathered


def _block_params(cfg: ModelConfig, layout: Layout, moe: bool) -> tuple[int, int]:
    """(dense, experts): the parameters one rank holds of one dense or MoE block (before ZeRO)."""
    tp = layout.dims.tp
    attn, attn_extra = _attention_weights(cfg)
    if cfg.attention == "mla":  # the latent down-projections are replicated over tp, the rest split by heads
        m, d = cfg.mla, cfg.d_model
        latent = d * (m.kv_lora_rank + m.qk_rope_head_dim) + (d * m.q_lora_rank if m.q_lora_rank else 0)
        attn_local = latent + (attn - latent) // tp + attn_extra
    else:
        attn_local = attn // tp + attn_extra // tp
    dense = attn_local + 2 * cfg.d_model  # two RMSNorm gains per block, replicated
    if not moe:
        w, b = _dense_mlp(cfg)
        return dense + (w + b) // tp, 0
    m, d = cfg.moe, cfg.d_model
    d_expert = m.d_expert or cfg.d_ff
    dense += d * m.n_experts + 3 * d * d_expert * m.n_shared_experts  # router, shared experts
    return dense, 3 * d * d_expert * m.n_experts // layout.dims.ep


def rank_params(cfg: ModelConfig, layout: Layout, stage: int = 0, mtp_depth: int = 0) -> dict[str, int]:
    """{"dense", "experts"}: parameters held by one rank of pipeline stage `stage` (before ZeRO); `mtp_depth`:
    multi-token prediction's weights beside its blocks on the head's rank (`plan.mtp`; `cfg` counts its blocks)."""
    tp = layout.dims.tp
    o = layout.options
    n_dense, n_moe = stage_kinds(cfg, layout.dims.pp, o.virtual_stages, stage, o.schedule)
    (dense_block, _), (moe_dense, moe_experts) = _block_params(cfg, layout, False), _block_params(cfg, layout, True)
    dense = n_dense * dense_block + n_moe * moe_dense
    experts = n_moe * moe_experts
    if stage == 0:
        dense += cfg.vocab_size * cfg.d_model // tp
    if stage == head_stage(o.schedule, layout.dims.pp):  # under a V the first stage: a tied head is its embedding
        tied_here = cfg.tie_embeddings and stage == 0
        dense += cfg.d_model + (0 if tied_here else cfg.vocab_size * cfg.d_model // tp)
        dense += mtp.head_params(cfg, mtp_depth, tp)
    return {"dense": dense, "experts": experts}


def model_state_bytes(cfg: ModelConfig, layout: Layout, precision: Precision = FP32,
                      stage: int = 0, mtp_depth: int = 0) -> dict[str, float]:
    """{"params", "grads", "optimizer"}: bytes one rank of stage `stage` holds, ZeRO applied per replica group
    (`memory.model_state_bytes` of each kind of parameter; `Precision.optimizer` includes the master copy; a
    `Precision.grad_buffer` "full" keeps every gradient of the rank's shard whatever the stage; `grad_copies` and,
    for parameters with replicas, `ddp_bucket` are whole copies beside it)."""
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for kind, n in rank_params(cfg, layout, stage, mtp_depth).items():
        states = memory.model_state_bytes(n, precision.param, precision.grad, master_bytes=0,
                                          optimizer_bytes=precision.optimizer, zero=layout.options.zero,
                                          dp=layout.replicas[kind])
        if precision.grad_buffer == "full":  # one buffer for the rank's whole shard, whatever the ZeRO stage
            states["grads"] = precision.grad * n
        states["grads"] += (precision.grad_copies + (precision.ddp_bucket if layout.replicas[kind] > 1 else 0)) * n
        for part in out:
            out[part] += states[part]
    return out


def _norm_bytes(n: int, dim: int, p: int, sp_tp: int = 1, fused: bool = False) -> float:
    # RMSNorm: its fp32 input, 1/rms, the normalized tensor (a fused kernel: its input as it is and 1/rms); its
    # output counted by the caller (a linear's input).
    return (p * n * dim + 4 * n if fused else 4 * n * dim + 4 * n + p * n * dim) / sp_tp


def _region_input_bytes(n: int, d: int, p: int, sp: int, fused_norm: bool, sp_regather: bool) -> float:
    """A region's (attention's, the feed-forward's, the head's) norm and the input its first linears save: whole
    (no SP), gathered over the sequence (the trainer's SP), or sharded and gathered again backward (Megatron's)."""
    return _norm_bytes(n, d, p, sp, fused_norm) + p * n * d / (sp if sp_regather else 1)


def layer_activation_bytes(cfg: ModelConfig, layer: int, tokens: int, layout: Layout, p: int,
                           fused: bool = False, sp_regather: bool = False, fused_norm: bool | None = None) -> float:
    """Bytes one block saves for the backward for `tokens` tokens of one micro-batch on one rank (s/cp each), with
    this trainer's kernels or (`fused`, `sp_regather`, `fused_norm`: `Precision`'s) Megatron-LM's."""
    tp, d = layout.dims.tp, cfg.d_model
    n = tokens
    sp = layout.sp_degree
    fused_norm = fused if fused_norm is None else fused_norm
    norms = 2 * _region_input_bytes(n, d, p, sp, fused_norm, sp_regather)
    swiglu = 3 if fused else 4  # x·W1, x·W3, the SiLU, the product (fused: the first two and the product)
    if cfg.attention == "mla":
        m, h = cfg.mla, cfg.n_heads // tp
        d_qk, d_v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        # the latent, normed, into wkv_b
        latents = _norm_bytes(n, m.kv_lora_rank, p, fused=fused_norm) + p * n * m.kv_lora_rank
        if m.q_lora_rank:
            latents += _norm_bytes(n, m.q_lora_rank, p, fused=fused_norm) + p * n * m.q_lora_rank
        # q before and after RoPE, k assembled, v, the kernel's output and its copy into wo (fused: q, k, v, the
        # output); fp32 log-sum-exp
        copies = 2 if fused else 3
        attention = latents + p * n * h * copies * (d_qk + d_v) + 4 * n * h
    else:
        kv = kv_heads_per_rank(cfg, tp) * cfg.head_dim
        q = cfg.n_heads // tp * cfg.head_dim
        attention = p * n * ((2 if fused else 3) * q + 2 * kv) + 4 * n * cfg.n_heads // tp  # q before RoPE too
    attention += gathered_kv_bytes(cfg, n, tp, layout.dims.cp, layout.options.cp_impl, p)
    if _is_moe_layer(cfg, layer):
        moe = cfg.moe
        k, e, d_expert = moe.top_k, moe.n_experts, moe.d_expert or cfg.d_ff
        slots = n * k  # rows through the experts, balanced over ep ranks: n·k per rank on average
        # fp32 scores and logits (the z-loss), chosen indices, chosen and per-slot gates, two per-token sums
        router = 4 * n * e * 2 + n * k * (8 + 4 + 4) + 8 * n
        # the gathered rows, the experts' outputs and the gated ones (index_add keeps its source), two indices
        rows = 3 * p * slots * d + 8 * slots * 2
        experts = swiglu * p * slots * d_expert
        shared = swiglu * p * n * d_expert * moe.n_shared_experts
        mlp = router + rows + experts + shared
    else:
        mlp = swiglu * p * n * cfg.d_ff // tp
    return norms + attention + mlp


def _block_matmuls(cfg: ModelConfig, layer: int, tp: int) -> list[tuple[int, int]]:
    """(input width, output width) per token of each `aten.mm` a block runs on one of `tp` ranks, in the forward's
    order (a row-parallel linear's output whole before its reduction; routed experts run grouped GEMMs, not `mm`)."""
    d = cfg.d_model
    if cfg.attention == "mla":
        m, h = cfg.mla, cfg.n_heads // tp
        d_qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        q = [(d, m.q_lora_rank), (m.q_lora_rank, h * d_qk)] if m.q_lora_rank else [(d, h * d_qk)]
        mms = [*q, (d, m.kv_lora_rank + m.qk_rope_head_dim),
               (m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim)), (h * m.v_head_dim, d)]
    else:
        q, kv = cfg.n_heads // tp * cfg.head_dim, kv_heads_per_rank(cfg, tp) * cfg.head_dim
        mms = [(d, q), (d, kv), (d, kv), (q, d)]
    if not _is_moe_layer(cfg, layer):
        return mms + [(d, cfg.d_ff // tp), (d, cfg.d_ff // tp), (cfg.d_ff // tp, d)]
    d_expert = cfg.moe.d_expert or cfg.d_ff
    return mms + [(d, cfg.moe.n_experts)] + [(d, d_expert), (d, d_expert), (d_expert, d)] * cfg.moe.n_shared_experts


def alternate_recomputed_flops_per_token(cfg: ModelConfig) -> float:
    """FLOPs per token, all blocks, of the matmuls torchtitan's op-level policy runs again (every second one)."""
    return sum(2.0 * a * b for layer in range(cfg.n_layers) for a, b in _block_matmuls(cfg, layer, 1)[1::2])


def alternate_matmuls_bytes(cfg: ModelConfig, layer: int, tokens: int, layout: Layout, p: int,
                            residual: int) -> float:
    """Bytes a block keeps under torchtitan's op-level selective recomputation: its input, the 1st, 3rd, 5th, ...
    matmul's output and the attention kernel's output and log-sum-exp."""
    n, tp = tokens, layout.dims.tp
    kept = residual * n * cfg.d_model / layout.sp_degree + \
        p * n * sum(out for _, out in _block_matmuls(cfg, layer, tp)[::2])
    heads = cfg.n_heads // tp
    v_dim = cfg.mla.v_head_dim if cfg.attention == "mla" else cfg.head_dim
    return kept + p * n * heads * v_dim + 4 * n * heads


def selective_layer_bytes(cfg: ModelConfig, layer: int, tokens: int, layout: Layout, p: int, residual: int) -> float:
    """Bytes one block keeps under selective recomputation (`train.blocks.keep_matmuls`): its input (the
    checkpoint's, sequence-split under SP) and the output of every matmul and of the attention kernel; norms, RoPE,
    SiLU, products, adds and collectives are recomputed. A row-parallel linear's output is whole ([n, d]) on every
    tp rank before its reduction; MoE experts see n·k rows on average (balanced routing)."""
    tp, d, n = layout.dims.tp, cfg.d_model, tokens
    kept = residual * n * d / layout.sp_degree
    if cfg.attention == "mla":
        m, h = cfg.mla, cfg.n_heads // tp
        d_qk, d_v = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
        q_path = (m.q_lora_rank + h * d_qk) if m.q_lora_rank else h * d_qk
        # q's projections, the latent (+ its rope part), wkv_b's keys and values, wo; the kernel's output and lse
        attention = p * n * (q_path + m.kv_lora_rank + m.qk_rope_head_dim + h * (m.qk_nope_head_dim + d_v) + d)
        attention += p * n * h * d_v + 4 * n * h
    else:
        kv = kv_heads_per_rank(cfg, tp) * cfg.head_dim
        q = cfg.n_heads // tp * cfg.head_dim
        attention = p * n * (2 * q + 2 * kv + d) + 4 * n * cfg.n_heads // tp  # q, k, v, wo; kernel's output, lse
    if _is_moe_layer(cfg, layer):
        moe = cfg.moe
        d_expert = moe.d_expert or cfg.d_ff
        slots = n * moe.top_k
        mlp = p * n * moe.n_experts + p * slots * (2 * d_expert + d)  # router logits; w1, w3 and w2 per row
        mlp += moe.n_shared_experts * p * n * (2 * d_expert + d)
    else:
        mlp = p * n * (2 * cfg.d_ff // tp + d)  # w1, w3 (column-parallel) and w2 (whole before the reduction)
    return kept + attention + mlp


def head_activation_bytes(cfg: ModelConfig, tokens: int, layout: Layout, p: int, fused: bool = False,
                          sp_regather: bool = False, fused_norm: bool | None = None) -> float:
    """The last stage's final norm, the head's input and the loss's fp32 softmax over the vocabulary shard."""
    fused_norm = fused if fused_norm is None else fused_norm
    return _region_input_bytes(tokens, cfg.d_model, p, layout.sp_degree, fused_norm, sp_regather) + \
        4 * tokens * cfg.vocab_size / layout.dims.tp + 8 * tokens


def loss_transient_bytes(cfg: ModelConfig, tokens: int, tp: int, fused_loss: bool) -> float:
    """What the loss holds beyond the fp32 softmax it saves, at its peak. Eager (`F.cross_entropy` over the logits'
    fp32 copy, this trainer's and torchtitan's): the fp32 logits beside the softmax forward, then the softmax's
    incoming and outgoing gradients backward, 8 bytes per logit (tests/test_plan_inputs.py measures it). Fused
    (Megatron-LM's vocab-parallel cross-entropy: exp in place, the gradient written into the saved softmax): the bf16
    logits beside their fp32 copy, 2 bytes per logit."""
    return (2 if fused_loss else 8) * tokens * cfg.vocab_size / tp


def zero3_gathered_bytes(cfg: ModelConfig, layout: Layout, precision: Precision, stage: int) -> float:
    """ZeRO-3's working set: two units' weights gathered whole (the one computing, the next prefetched, as FSDP2
    does) and one unit's unsharded gradients before their reduce-scatter. A unit is a block, or the embedding or the
    head on the ranks that hold them; the largest this rank holds is charged."""
    if layout.options.zero != 3:
        return 0.0
    n_dense, n_moe = stage_kinds(cfg, layout.dims.pp, layout.options.virtual_stages, stage, layout.options.schedule)
    units = [sum(_block_params(cfg, layout, moe)) for moe, n in ((False, n_dense), (True, n_moe)) if n]
    holds_vocab = stage == 0 or stage == head_stage(layout.options.schedule, layout.dims.pp)
    units += [cfg.vocab_size * cfg.d_model // layout.dims.tp] if holds_vocab else []
    return max(units, default=0) * (2 * precision.param + precision.grad)


def memoized(memo: dict | None, key: tuple, compute: Callable[[], T]) -> T:
    """`compute()`, kept in `memo` under `key` (a search's dict: the pieces many layouts share computed once);
    None: computed every call."""
    if memo is None:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def _block_bytes(cfg: ModelConfig, layout: Layout, tokens: int, precision: Precision, memo: dict | None
                 ) -> tuple[float, float, float, float]:
    """(a dense block's saved bytes, an MoE block's, the same kept under selective recomputation): the same for
    every stage, so a search (`memo`: its own dict, one model) computes them once per shape."""
    key = ("blocks", tokens, layout.dims.tp, layout.sp_degree, layout.dims.cp, layout.options.cp_impl)
    first_moe, p, r = first_moe_layer(cfg), precision.activation, precision.residual
    moe_index = first_moe if first_moe < cfg.n_layers else 0
    kernels = (precision.fused, precision.sp_regather, precision.fused_norm)

    def saved(layer: int) -> float:
        if precision.fp8_saved:
            return deepseek_saves.layer_bytes(cfg, layer, tokens, layout, r)
        return layer_activation_bytes(cfg, layer, tokens, layout, p, *kernels)
    def kept(layer: int) -> float:  # under selective recomputation, by the stack's policy
        if precision.selective == "core_attention":
            return saved(layer)
        policy = alternate_matmuls_bytes if precision.selective == "alternate_matmuls" else selective_layer_bytes
        return policy(cfg, layer, tokens, layout, p, r)
    return memoized(memo, key, lambda: (saved(0), saved(moe_index), kept(0), kept(moe_index)))


def activation_bytes(cfg: ModelConfig, layout: Layout, seq_len: int, micro_batch: int, precision: Precision = FP32,
                     stage: int = 0, memo: dict | None = None, mtp_depth: int = 0) -> tuple[float, float]:
    """(activations held at the worst moment of a step, the recomputed block's transient) for pipeline rank
    `stage`, `micro_batch` sequences of `seq_len` tokens per micro-batch on one rank (`mtp_depth`: `rank_params`')."""
    p = precision.activation
    dims, options = layout.dims, layout.options
    tokens = micro_batch * seq_len // dims.cp
    # Blocks of one kind (dense or MoE) save the same bytes: one evaluation per kind (the planner calls this a lot).
    n_dense, n_moe = stage_kinds(cfg, dims.pp, options.virtual_stages, stage, options.schedule)
    dense_b, moe_b, dense_s, moe_s = _block_bytes(cfg, layout, tokens, precision, memo)
    per_kind = [(n, b) for n, b in ((n_dense, dense_b), (n_moe, moe_b)) if n]
    sp = layout.sp_degree
    if layout.recompute == "full":
        kept = (n_dense + n_moe) * precision.residual * tokens * cfg.d_model / sp  # each block's input
        transient = max(b for _, b in per_kind)
    elif layout.recompute == "selective":
        selective = [(n, b, s) for n, b, s in ((n_dense, dense_b, dense_s), (n_moe, moe_b, moe_s)) if n]
        kept = sum(n * s for n, _, s in selective)
        transient = max(max(b - s, 0.0) for _, b, s in selective)  # one block's rebuilt element-wise tensors
    else:
        kept, transient = sum(n * b for n, b in per_kind), 0.0
    last = stage == head_stage(options.schedule, dims.pp)  # the rank that holds the head
    one_chunk_pass = kept / chunks_per_rank(options.schedule, options.virtual_stages)  # zbv: two chunks implied
    in_flight = chunks_in_flight(options.schedule, dims.pp, options.microbatches, options.virtual_stages, stage)
    total = one_chunk_pass * in_flight
    if last:
        total += head_activation_bytes(cfg, tokens, layout, p, precision.fused, precision.sp_regather,
                                       precision.fused_norm)
        total += mtp_depth * mtp.head_activation_bytes(cfg, tokens, dims.tp, p)
    if stage == 0:
        total += 8 * tokens  # the embedding's token indices
    return total, transient


def estimate_memory(cfg: ModelConfig, layout: Layout, seq_len: int, micro_batch: int, precision: Precision = FP32,
                    stage: int | None = None, memo: dict | None = None, mtp_depth: int = 0) -> MemoryEstimate:
    """Bytes per rank of pipeline stage `stage`; None: of the heaviest stage, named in `MemoryEstimate.stage`.

    Which stage that is depends on the layer mix and the micro-batches in flight: the first holds the embedding and
    the most micro-batches in flight, the last the head, but a middle stage of an MoE model whose first layers are
    dense (DeepSeek-V3: three) holds more experts than the first. Every stage is looked at (`stage_classes`), each
    class of stages that could be the heaviest evaluated once. `memo`: a dict a search passes to every call (one
    model, one precision), to compute the pieces shared by many layouts once. `mtp_depth`: `rank_params`'."""
    d, o = layout.dims, layout.options
    if stage is None:
        key = ("classes", d.pp, o.schedule, o.microbatches, o.virtual_stages)
        stages = memoized(memo, key, lambda: stage_classes(cfg, layout))
        return max((estimate_memory(cfg, layout, seq_len, micro_batch, precision, s, memo, mtp_depth)
                    for s in stages),
                   key=lambda e: e.total)
    key = ("states", d, o.zero, placement(o.schedule, o.virtual_stages), stage)  # `memo`: one precision
    states = memoized(memo, key, lambda: model_state_bytes(cfg, layout, precision, stage, mtp_depth))
    # the same for every dp, ep and ZeRO stage (balanced routing: n·k rows per rank whatever ep): computed once
    key = ("acts", d.tp, d.cp, d.pp, layout.sp_degree, o.cp_impl, o.schedule, o.microbatches, o.virtual_stages,
           layout.recompute, micro_batch, seq_len, stage)
    acts, transient = memoized(memo, key, lambda: activation_bytes(cfg, layout, seq_len, micro_batch, precision,
                                                                   stage, memo, mtp_depth))
    head = stage == head_stage(o.schedule, d.pp)
    fused_loss = precision.fused if precision.fused_loss is None else precision.fused_loss
    loss = loss_transient_bytes(cfg, micro_batch * seq_len // d.cp, d.tp, fused_loss) if head else 0.0
    gathered = zero3_gathered_bytes(cfg, layout, precision, stage)
    return MemoryEstimate(states["params"], states["grads"], states["optimizer"], acts, transient, stage, loss,
                          gathered)


def stage_classes(cfg: ModelConfig, layout: Layout) -> list[int]:
    """The pipeline ranks that could be the heaviest: of the stages with the same blocks (dense and MoE) and the
    same role (first, last, neither), the one with the most chunks in flight (more in flight, more activations,
    the same model states)."""
    dims, o = layout.dims, layout.options
    most: dict[tuple, tuple[int, int]] = {}  # class -> (chunks in flight, stage)
    for s in range(dims.pp):
        head = s == head_stage(o.schedule, dims.pp)
        key = (stage_kinds(cfg, dims.pp, o.virtual_stages, s, o.schedule), s == 0, head)
        flight = chunks_in_flight(o.schedule, dims.pp, o.microbatches, o.virtual_stages, s)
        if key not in most or flight > most[key][0]:
            most[key] = (flight, s)
    return [s for _, s in most.values()]
