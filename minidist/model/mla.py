"""Multi-head latent attention (MLA; DeepSeek-AI 2024, "DeepSeek-V2", §2.1, eqs. 9–19).

Keys and values of all heads are rebuilt from one small latent per token, so a decoder caches only that latent:

    c_KV = RMSNorm(W_DKV h)                    [kv_lora_rank]                    (eq. 9; kv_norm as in the release)
    k_C, v_C = W_UK c_KV, W_UV c_KV            [n_heads · qk_nope], [n_heads · v] (eqs. 10–11)
    k_R = RoPE(W_KR h)                         [qk_rope], ONE head shared by all (eqs. 14–15)
    q_C = W_UQ RMSNorm(W_DQ h)  (or W_Q h)     [n_heads · qk_nope]              (eqs. 12–13)
    q_R = RoPE(W_QR ...)                       [n_heads · qk_rope]              (eqs. 14–15)
    o_h = softmax([q_C,h; q_R,h]·[k_C,h; k_R] / √(qk_nope + qk_rope)) v_C,h       (eqs. 16–18)
    u = W_O [o_1; ...; o_H]                                                       (eq. 19)

RoPE is "decoupled": a rotation between W_UK and the query would sit inside q·k and stop W_UK from being folded
into the query, so positions live in separate rope dimensions with their own key (cached too, one head).

Inference with absorption: q_C,hᵀ k_C,h = (W_UK,hᵀ q_C,h)ᵀ c_KV, so W_UK folds into the query projection and
attention runs against the cached latents directly; likewise W_UV folds into W_O. The cache per token and layer
is kv_lora_rank + qk_rope_head_dim numbers (see `minidist.model.kv_cache`).

Weight names follow DeepSeek's release: wq (or wq_a, q_norm, wq_b), wkv_a = [W_DKV; W_KR], kv_norm,
wkv_b = [W_UK; W_UV] per head, wo. The query projection stacks [nope; rope] per head as well.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from einops import rearrange
from torch import nn

from minidist.model.attention import CausalAttention, rope_for_heads
from minidist.model.config import ModelConfig
from minidist.model.documents import Documents
from minidist.model.kv_cache import LatentKVCache
from minidist.model.layers import RMSNorm
from minidist.model.rope import apply_rotary, yarn_attention_scale

Rope = tuple[torch.Tensor, torch.Tensor] | None


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1/√(qk_nope + qk_rope), times the YaRN scale squared when YaRN is on.

    DeepSeek-V2/V3 put the YaRN temperature into the softmax scale (their `softmax_scale *= mscale²`) because
    only the rope dimensions are rotated: scaling cos/sin would temper only part of each logit.
    """
    scale = 1.0 / math.sqrt(cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim)
    if cfg.rope_scaling.kind == "yarn":
        scale *= yarn_attention_scale(cfg.rope_scaling.factor) ** 2
    return scale


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mla
        self.nope, self.rope_dim, self.v_dim, self.kv_rank = (m.qk_nope_head_dim, m.qk_rope_head_dim,
                                                              m.v_head_dim, m.kv_lora_rank)
        self.rope_layout = cfg.rope_layout
        self.softmax_scale = mla_softmax_scale(cfg)
        qk = self.nope + self.rope_dim
        # No biases: absorption folds matrices into each other, and DeepSeek's projections have none.
        if m.q_lora_rank is None:
            self.wq = nn.Linear(cfg.d_model, cfg.n_heads * qk, bias=False)
        else:
            self.wq_a = nn.Linear(cfg.d_model, m.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(m.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(m.q_lora_rank, cfg.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.d_model, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = RMSNorm(self.kv_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, cfg.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.v_dim, cfg.d_model, bias=False)
        self.core = CausalAttention()  # the expanded per-head keys and values go in (context parallelism swaps it)

    @property
    def n_heads(self) -> int:
        # Read from the weight, so a tensor-parallel shard with fewer heads works unchanged.
        return self.wkv_b.out_features // (self.nope + self.v_dim)

    # -- shared pieces --------------------------------------------------------------------------------------------

    def _query_input(self, x: torch.Tensor) -> torch.Tensor:
        return x if hasattr(self, "wq") else self.q_norm(self.wq_a(x))

    def _query_weight(self) -> torch.Tensor:
        return (self.wq if hasattr(self, "wq") else self.wq_b).weight

    def _queries(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """q_nope [B, H, T, nope] and rotated q_rope [B, H, T, rope]."""
        q = nn.functional.linear(self._query_input(x), self._query_weight())
        q = rearrange(q, "b t (h e) -> b h t e", h=self.n_heads)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        return q_nope, self._rotate(q_rope, rope_for_heads(rope))

    def _latents(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """What a decoder caches: c_KV [B, T, kv_rank] (normalized) and the rotated shared key k_rope [B, T, rope]."""
        c_kv, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        return self.kv_norm(c_kv), self._rotate(k_rope, rope)

    def _rotate(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        if rope is None:
            return x
        cos, sin = rope
        return apply_rotary(x, cos, sin, self.rope_layout)

    # -- training / naive path ------------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, rope: Rope = None, docs: Documents | None = None) -> torch.Tensor:
        """Naive path: expand the latents into per-head keys and values, then ordinary causal attention (within
        each document with `docs`). The absorbed path below is for decoding and takes no document mask."""
        heads = self.n_heads
        q_nope, q_rope = self._queries(x, rope)
        c_kv, k_rope = self._latents(x, rope)
        kv = rearrange(self.wkv_b(c_kv), "b t (h e) -> b h t e", h=heads)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope[:, None].expand(-1, heads, -1, -1)), dim=-1)
        extra = {} if docs is None else {"docs": docs}  # a swapped-in core without documents keeps working
        y = self.core(q, k, v, scale=self.softmax_scale, **extra)
        return self.wo(rearrange(y, "b h t v -> b t (h v)"))

    # -- inference / absorbed path --------------------------------------------------------------------------------

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_q_latent [H, kv_rank, q_in], W_o_latent [d_model, H, kv_rank]).

        W_q_latent,h = W_UK,hᵀ · W_Q_nope,h maps the query input straight to the latent space of head h;
        W_o_latent[:, h] = W_O,h · W_UV,h maps head h's latent-space output straight to the residual stream.
        """
        heads = self.n_heads
        w_kv_b = rearrange(self.wkv_b.weight, "(h e) r -> h e r", h=heads)
        w_uk, w_uv = w_kv_b.split([self.nope, self.v_dim], dim=1)  # [H, nope, r], [H, v, r]
        w_q = rearrange(self._query_weight(), "(h e) i -> h e i", h=heads)[:, : self.nope]  # [H, nope, q_in]
        w_q_latent = torch.einsum("hnr,hni->hri", w_uk, w_q)
        w_o = rearrange(self.wo.weight, "d (h v) -> d h v", h=heads)
        w_o_latent = torch.einsum("dhv,hvr->dhr", w_o, w_uv)
        return w_q_latent, w_o_latent

    def forward_absorbed(self, x: torch.Tensor, rope: Rope = None, cache: LatentKVCache | None = None
                         ) -> torch.Tensor:
        """Attend over the latents c_KV and the shared k_rope, never building per-head keys or values.

        With a cache, x holds the new tokens only (rope must be for their positions); their latents are appended
        and the queries attend to everything cached so far. Equal to `forward` up to rounding.
        """
        w_q_latent, w_o_latent = self.absorbed_weights()
        batch, seq, _ = x.shape
        q_in = self._query_input(x)
        q_latent = torch.einsum("bti,hri->bhtr", q_in, w_q_latent)
        w_q_rope = rearrange(self._query_weight(), "(h e) i -> h e i", h=self.n_heads)[:, self.nope:]
        q_rope = self._rotate(torch.einsum("bti,hpi->bhtp", q_in, w_q_rope), rope_for_heads(rope))
        c_kv, k_rope = self._latents(x, rope)
        if cache is not None:
            c_kv, k_rope = cache.append(c_kv, k_rope)
        total = c_kv.shape[1]
        scores = (torch.einsum("bhtr,bsr->bhts", q_latent, c_kv)
                  + torch.einsum("bhtp,bsp->bhts", q_rope, k_rope)) * self.softmax_scale
        # Query t sits at absolute position total − seq + t and may see keys 0 .. that position.
        q_pos = torch.arange(total - seq, total, device=x.device)[:, None]
        visible = torch.arange(total, device=x.device)[None, :] <= q_pos
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        o_latent = torch.einsum("bhts,bsr->bthr", probs, c_kv)
        return torch.einsum("bthr,dhr->btd", o_latent, w_o_latent)


# Attention shapes of released DeepSeek models, for KV-cache arithmetic (chapter 05). Only the attention-related
# fields: the MoE feed-forward of these models is chapter 06's. Values from the released config.json files.
MLA_REFERENCE_CONFIGS: dict[str, dict[str, Any]] = {
    # DeepSeek-AI 2024, "DeepSeek-V2" (236B total / 21B active), §2.1.
    "deepseek-v2": dict(vocab_size=102400, d_model=5120, n_layers=60, n_heads=128, max_seq_len=163840,
                        attention="mla",
                        mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                 v_head_dim=128),
                        rope_scaling=dict(kind="yarn", factor=40.0, original_max_seq_len=4096)),
    # DeepSeek-V2-Lite (15.7B / 2.4B active): no query compression.
    "deepseek-v2-lite": dict(vocab_size=102400, d_model=2048, n_layers=27, n_heads=16, max_seq_len=163840,
                             attention="mla",
                             mla=dict(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                                      qk_rope_head_dim=64, v_head_dim=128),
                             rope_scaling=dict(kind="yarn", factor=40.0, original_max_seq_len=4096)),
    # DeepSeek-AI 2024, "DeepSeek-V3 Technical Report" (671B / 37B active).
    "deepseek-v3": dict(vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, max_seq_len=163840,
                        attention="mla",
                        mla=dict(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                 v_head_dim=128),
                        rope_scaling=dict(kind="yarn", factor=40.0, original_max_seq_len=4096)),
}


def mla_reference_config(name: str) -> ModelConfig:
    """The attention shape of a released DeepSeek model as a ModelConfig (dense MLP; for cache arithmetic)."""
    from minidist.model.config import config_from_dict

    if name not in MLA_REFERENCE_CONFIGS:
        raise ValueError(f"unknown MLA reference config {name!r}; choose one of {sorted(MLA_REFERENCE_CONFIGS)}")
    return config_from_dict(MLA_REFERENCE_CONFIGS[name]).validate()
