"""Causal self-attention: multi-head (MHA), grouped-query (GQA, Ainslie et al. 2023) and multi-query (MQA).

GQA shares each key/value head among n_heads / n_kv_heads query heads. The head counts are read from the weight
shapes at run time, so a tensor-parallel swap that gives a rank fewer heads needs no change here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from minidist.model.config import ModelConfig
from minidist.model.documents import Documents, document_attention
from minidist.model.rope import apply_rotary

Rope = tuple[torch.Tensor, torch.Tensor] | None  # (cos, sin) for the positions of this forward, or None


def rope_for_heads(rope: Rope) -> Rope:
    """(cos, sin) shaped to rotate [B, H, T, d]: per-row positions give [B, T, d/2], which needs a heads axis."""
    if rope is None or rope[0].dim() < 3:
        return rope
    return rope[0][:, None], rope[1][:, None]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """softmax(q kᵀ·scale + causal mask) v for [B, H, T, d] tensors (scale None: 1/√d); k and v may have fewer
    heads (GQA).

    Key/value head j serves query heads j·g .. j·g+g−1 (g = H / H_kv), as repeat_interleave would lay them out;
    enable_gqa lets the kernel do that without materializing the repeated k and v (≈4% of a training step of the
    `small` preset on CPU, measured by bench/model.py).
    """
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


class CausalAttention(nn.Module):
    """The attention core, `causal_attention` as a module without parameters: q, k, v of this rank's tokens in,
    the attended values out; with `docs`, block-diagonal causal (`minidist.model.documents`). Context parallelism
    (chapter 10) swaps it for a core that attends across ranks."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        if docs is not None:
            return document_attention(q, k, v, docs, scale)
        return causal_attention(q, k, v, scale)

    def prepare_documents(self, docs: Documents) -> None:
        """Build the mask this core reads (the whole sequence's, on CUDA) before the blocks, outside any compiled
        block."""
        docs.flex_mask()


class GroupedQueryAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.rope_layout = cfg.rope_layout
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.bias)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=cfg.bias)
        self.core = CausalAttention()

    def forward(self, x: torch.Tensor, rope: Rope = None, docs: Documents | None = None) -> torch.Tensor:
        # Split heads; their number h follows from the weight shape (fewer on a tensor-parallel rank).
        q = rearrange(self.wq(x), "b t (h d) -> b h t d", d=self.head_dim)
        k = rearrange(self.wk(x), "b t (h d) -> b h t d", d=self.head_dim)
        v = rearrange(self.wv(x), "b t (h d) -> b h t d", d=self.head_dim)
        if rope is not None:
            cos, sin = rope_for_heads(rope)
            q = apply_rotary(q, cos, sin, self.rope_layout)
            k = apply_rotary(k, cos, sin, self.rope_layout)
        y = self.core(q, k, v) if docs is None else self.core(q, k, v, docs=docs)  # a core may not know docs
        return self.wo(rearrange(y, "b h t d -> b t (h d)"))
