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


def block_values(cfg: ModelConfig, layout: Layout, moe: bool) -> tuple[float, float]:
    """(forward, backward) values one token moves through HBM in one block's element-wise operators on one rank
    (the module docstring's table)."""
    d, tp, sp = cfg.d_model, layout.dims.tp, layout.sp_degree
    forward, backward = 2 * 2 * d / sp + 2 * 3 * d / sp, 2 * 3 * d / sp + 2 * 3 * d / sp  # norms, residual adds
    rope = 2 * _rotated(cfg, tp)
    forward, backward = forward + rope, backward + rope
    if cfg.attention == "mla":
        ranks = cfg.mla.kv_lora_rank + (cfg.mla.q_lora_rank or 0)
        forward, backward = forward + 2 * ranks, backward + 3 * ranks
    if moe:
        m = cfg.moe
        width = (m.top_k + m.n_shared_experts) * (m.d_expert or cfg.d_ff)
        k = m.top_k
        forward, backward = forward + 3 * k * d + d, backward + 3 * k * d + d  # permute, combine
    else:
        width = cfg.d_ff // tp
    mlp_forward, mlp_backward = _mlp_values(width, gated=moe or cfg.mlp == "swiglu")  # experts are SwiGLU
    return forward + mlp_forward, backward + mlp_backward


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
            residual_adds = 2 * 3 * cfg.d_model / layout.sp_degree
            routing = (3 * cfg.moe.top_k + 1) * cfg.d_model if moe else 0  # the permutation and the combine
            again = forward - residual_adds - routing  # the norms, RoPE, the gated activation
            values += count * (forwards * forward + backward + (again if replayed else 0.0))
    return tokens * values * p / hbm_bandwidth
