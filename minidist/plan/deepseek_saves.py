"""What DeepSeek-V3's kernels save for the backward, and what they recompute instead (DeepSeek-AI 2024,
*DeepSeek-V3 Technical Report*, §3.2.3 "Extremely Memory Saving with Minimal Overhead" and §3.3.2 "Low-Precision
Storage"): the planner's `--kernels deepseek` (`rank_memory.BF16_DEEPSEEK`, with the FP8 recipe it implies).

Per token and block on one rank, without further recomputation (n tokens; r bytes per residual value; an FP8 value
1 byte plus a 4-byte scale per 1×128 tile; tp splits the heads and a dense MLP's width, sequence parallelism the
residual stream):

    block         its input and the MLP's input (r each, split by sp): every RMSNorm is recomputed from them, its
                  output, the next linears' input, not kept (§3.2.3)
    MLA           q's latent and kv's latent with the shared rotary key, in bf16 (replicated over tp, as their
                  down-projections): the up-projections are recomputed from them (§3.2.3), so q, k and v are not
                  kept (a model without q's latent keeps q); the attention's output in E5M6 (12 bits, §3.3.2
                  (1)), the input of the output projection and of the attention's backward; the fp32 log-sum-exp
    GQA/MHA       q, k, v in bf16 (the attention kernel's backward reads them), the output in E5M6, the lse
    dense MLP     SwiGLU's input [x·W1, x·W3] in FP8: its output, the down-projection's input, recomputed
                  (§3.3.2 (2) states it for the MoE layers; the three dense blocks are taken to run alike)
    MoE           the router's fp32 scores, the chosen indices and gates; each routed row as it arrived (the
                  experts' first input, dispatched in FP8, §3.3.4); each routed and shared expert's SwiGLU input in
                  FP8. The experts' outputs are not kept: a gate's gradient ⟨dy, W2·h⟩ equals ⟨W2ᵀ·dy, h⟩, whose
                  left side the down-projection's backward computes anyway and h is recomputed

`step_time` charges what is recomputed: the MLA up-projections' GEMMs (`recomputed_flops_per_token`), the norms',
RoPE's and SwiGLU's element-wise forwards (`plan.elementwise`). Under all-gather context parallelism a block also
keeps the whole sequence's keys and values, in bf16, as `rank_memory` counts them for every kernel set.
"""

from __future__ import annotations

from minidist.flops import _is_moe_layer
from minidist.model.config import ModelConfig
from minidist.parallel.cp.core import kv_heads_per_rank
from minidist.parallel.cp.traffic import gathered_kv_bytes
from minidist.parallel.layout import Layout

FP8_BYTES = 1 + 4 / 128  # an FP8 value and its share of a 1×128 tile's fp32 scale
E5M6_BYTES = 1.5 + 4 / 128  # the attention output's 12-bit format, with the same tiles' scales
BF16_BYTES = 2


def attention_bytes(cfg: ModelConfig, tokens: int, tp: int) -> float:
    """Bytes the attention region keeps for `tokens` tokens on one tp rank, its input aside."""
    n = tokens
    if cfg.attention == "mla":
        m, h = cfg.mla, cfg.n_heads // tp
        # without a q latent, q is the projection of the normed input itself: kept, not recomputed
        q = m.q_lora_rank or h * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        latents = q + m.kv_lora_rank + m.qk_rope_head_dim
        return BF16_BYTES * n * latents + E5M6_BYTES * n * h * m.v_head_dim + 4 * n * h
    q = cfg.n_heads // tp * cfg.head_dim
    kv = kv_heads_per_rank(cfg, tp) * cfg.head_dim
    return BF16_BYTES * n * (q + 2 * kv) + E5M6_BYTES * n * q + 4 * n * cfg.n_heads // tp


def mlp_bytes(cfg: ModelConfig, layer: int, tokens: int, tp: int) -> float:
    """Bytes block `layer`'s MLP keeps for `tokens` tokens on one tp rank (an MoE layer runs whole on each), its
    input aside."""
    n = tokens
    if not _is_moe_layer(cfg, layer):
        return FP8_BYTES * n * 2 * cfg.d_ff // tp
    moe = cfg.moe
    d_expert = moe.d_expert or cfg.d_ff
    slots = n * moe.top_k  # balanced routing: n·k rows per rank on average
    router = 4 * n * moe.n_experts + slots * (8 + 4) + 8 * slots * 2  # scores; indices, gates; combine's indices
    rows = FP8_BYTES * slots * (cfg.d_model + 2 * d_expert)  # the arrived row, its SwiGLU input
    shared = FP8_BYTES * n * 2 * d_expert * moe.n_shared_experts
    return router + rows + shared


def layer_bytes(cfg: ModelConfig, layer: int, tokens: int, layout: Layout, residual: int) -> float:
    """Bytes block `layer` saves for its backward, `tokens` tokens of one micro-batch on one rank (the table)."""
    tp = layout.dims.tp
    inputs = 2 * residual * tokens * cfg.d_model / layout.sp_degree
    gathered = gathered_kv_bytes(cfg, tokens, tp, layout.dims.cp, layout.options.cp_impl, BF16_BYTES)
    return inputs + attention_bytes(cfg, tokens, tp) + gathered + mlp_bytes(cfg, layer, tokens, tp)


def recomputed_flops_per_token(cfg: ModelConfig) -> float:
    """FLOPs per token of the GEMMs the backward runs again, all blocks: MLA's up-projections, once more forward."""
    if cfg.attention != "mla":
        return 0.0
    m, h = cfg.mla, cfg.n_heads
    q_up = m.q_lora_rank * h * (m.qk_nope_head_dim + m.qk_rope_head_dim) if m.q_lora_rank else 0
    kv_up = m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim)
    return 2.0 * (q_up + kv_up) * cfg.n_layers
