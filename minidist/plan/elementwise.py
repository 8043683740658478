"""The element-wise kernels' time (chapter 12): the operators between a block's matmuls (its norms, RoPE, the gated
activation, the residual adds, an MoE layer's permutation of rows to experts and their weighted combine) do a few
FLOPs per value they touch, so HBM's bandwidth, not the tensor cores, sets their pace.

Charged as a lower bound: each operator fused into one kernel that reads its inputs and writes its outputs once, at
the chip's datasheet HBM bandwidth (`hardware.Chip.hbm_bandwidth`). Per token and block, in values (each of the
activations' `p` bytes), d the model width, f a gated MLP's hidden width on the rank (d_ff / tp for a dense block;
(top_k + shared) experts' widths for an MoE block, which runs whole on every tp rank, as in the trainer):

    forward   norms 2 · (d + d)  residual adds 2 · 3d  RoPE 2 · (q + k rotated)  SwiGLU 3f (GELU 2f)
    backward  norms 2 · 3d       residual adds 2 · 3d  RoPE 2 · (q + k rotated)  SwiGLU 5f (GELU 3f)
    MoE       forward: permute 2kd, combine kd + d; backward: 2kd, kd + d (k = top_k)
    MLA       the latent norms (q's and kv's ranks, replicated over tp): forward 2 · rank, backward 3 · rank each

Sequence parallelism splits the norms and residual adds over tp (`Layout.sp_degree`); tensor parallelism splits
the heads and a dense MLP's hidden width. Recomputation (full or selective) runs each block's forward operators
again. Left out: the head's cross-entropy (on the last stage only), the router's scores, FP8's casts (the
DeepSeek-V3 recipe fuses them into the GEMMs' neighbours), the optimizer step.
"""

from __future__ import annotations

from minidist.model.config import ModelConfig
from minidist.parallel.cp.core import kv_heads_per_rank
from minidist.parallel.layout import Layout


def _rotated(cfg: ModelConfig, tp: int) -> int:
    """Values RoPE rotates per token on one tp rank: its query heads' and key heads' rotary parts."""
    if cfg.position != "rope":
        return 0
    if cfg.attention == "mla":  # the rotary key part is one head shared by all, replicated over tp
        return cfg.n_heads // tp * cfg.mla.qk_rope_head_dim + cfg.mla.qk_rope_head_dim
    return (cfg.n_heads // tp + kv_heads_per_rank(cfg, tp)) * cfg.head_dim


def _mlp_values(width: int, gated: bool) -> tuple[int, int]:
    """(forward, backward) values the activation between an MLP's matmuls moves per token, `width` wide: SwiGLU
    reads two and writes one (backward: reads three, writes two), GELU reads one and writes one (two, one)."""
    return (3 * width, 5 * width) if gated else (2 * width, 3 * width)


def _mlp_width(cfg: ModelConfig, tp: int, moe: bool) -> int:
    """The gated activation's width per token on one rank: a dense block's d_ff / tp; an MoE block's (top_k +
    shared) experts' widths, whole on every tp rank."""
    if not moe:
        return cfg.d_ff // tp
    m = cfg.moe
    return (m.top_k + m.n_shared_experts) * (m.d_expert or cfg.d_ff)


def replayed_values(cfg: ModelConfig, layout: Layout, moe: bool) -> float:
    """Forward values one token moves through the operators a recomputing kernel set runs again in the backward
    (DeepSeek-V3's, `deepseek_saves`): the norms, RoPE, MLA's latent norms, the gated activation; not the residual
    adds nor an MoE layer's permutation and combine."""
    d, tp, sp = cfg.d_model, layout.dims.tp, layout.sp_degree
    values = 2 * 2 * d / sp + 2 * _rotated(cfg, tp)  # the norms, RoPE
    if cfg.attention == "mla":
        values += 2 * (cfg.mla.kv_lora_rank + (cfg.mla.q_lora_rank or 0))
    return values + _mlp_values(_mlp_width(cfg, tp, moe), gated=moe or cfg.mlp == "swiglu")[0]  # experts: SwiGLU


def block_values(cfg: ModelConfig, layout: Layout, moe: bool) -> tuple[float, float]:
    """(forward, backward) values one token moves through HBM in one block's element-wise operators on one rank
    (the module docstring's table)."""
    d, tp, sp = cfg.d_model, layout.dims.tp, layout.sp_degree
    adds = 2 * 3 * d / sp  # the residual adds, forward and backward alike
    routing = 3 * cfg.moe.top_k * d + d if moe else 0  # permute, combine
    backward = 2 * 3 * d / sp + adds + 2 * _rotated(cfg, tp) + routing  # the norms, RoPE
    if cfg.attention == "mla":
        backward += 3 * (cfg.mla.kv_lora_rank + (cfg.mla.q_lora_rank or 0))
    backward += _mlp_values(_mlp_width(cfg, tp, moe), gated=moe or cfg.mlp == "swiglu")[1]
    return replayed_values(cfg, layout, moe) + adds + routing, backward


def elementwise_seconds(cfg: ModelConfig, layout: Layout, tokens: float, kinds: tuple[int, int], p: int,
                        hbm_bandwidth: float, replayed: bool = False) -> float:
    """Seconds of the element-wise operators of one step on the busiest pipeline rank: `tokens` per rank and step
    through its `kinds` (dense, MoE) blocks, values of `p` bytes, at `hbm_bandwidth` bytes/s (0: not charged);
    `replayed`: the norms, RoPE and the gated activation run forward again in the backward (DeepSeek-V3's kernels,
    `deepseek_saves`), the residual adds and an MoE layer's permutations not."""
    if not hbm_bandwidth:
        return 0.0
    forwards = 1 if layout.recompute == "none" else 2
    values = 0.0
    for count, moe in zip(kinds, (False, True)):
        if count:
            forward, backward = block_values(cfg, layout, moe)
            again = replayed_values(cfg, layout, moe) if replayed else 0.0
            values += count * (forwards * forward + backward + again)
    return tokens * values * p / hbm_bandwidth
