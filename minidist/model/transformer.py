"""A Llama-style decoder-only transformer (and, by config, GPT-2/3's variant), in plain PyTorch.

Parallelism never branches inside this file: tensor, pipeline, context and expert parallelism are transformations
applied to a built model. Parameter names ("blocks.3.attn.wq.weight") are the keys of layout-independent init,
checkpoints and parity tests, so transformations keep them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from minidist.model.attention import GroupedQueryAttention, Rope
from minidist.model.config import ModelConfig
from minidist.model.documents import Documents
from minidist.model.init import init_parameters
from minidist.model.layers import build_mlp, build_norm
from minidist.model.mla import MultiHeadLatentAttention
from minidist.model.rope import rope_cos_sin, rope_for_config


def build_attention(cfg: ModelConfig) -> nn.Module:
    """The attention `cfg.attention` names: multi-head latent ("mla"), else grouped-query (MHA, GQA, MQA)."""
    if cfg.attention == "mla":
        return MultiHeadLatentAttention(cfg)
    return GroupedQueryAttention(cfg)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.attn_norm = build_norm(cfg)
        self.attn = build_attention(cfg)
        self.mlp_norm = build_norm(cfg)
        if cfg.moe.n_experts > 0 and layer_index >= cfg.moe.first_dense_layers:
            from minidist.model.moe.layer import MoELayer

            self.mlp = MoELayer(cfg, layer_index=layer_index)
        else:
            self.mlp = build_mlp(cfg)

    def forward(self, x: torch.Tensor, rope: Rope = None, docs: Documents | None = None) -> torch.Tensor:
        x = x + (self.attn(self.attn_norm(x), rope) if docs is None else self.attn(self.attn_norm(x), rope, docs))
        return x + self.mlp(self.mlp_norm(x))


class RotaryEmbedding(nn.Module):
    """Holds the RoPE frequencies (after any context-extension scaling) and turns positions into (cos, sin)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inv_freq, attention_scale = rope_for_config(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scale = attention_scale

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq, self.attention_scale)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.rotary = RotaryEmbedding(cfg) if cfg.position == "rope" else None
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = build_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None, *,
                docs: torch.Tensor | Documents | None = None, blocks: Sequence[int] | None = None, embed: bool = True,
                head: bool = True) -> torch.Tensor:
        """Logits [B, T, vocab] for tokens [B, T]; positions [T] (or per row, [B, T]) default to 0..T−1.

        `docs`: the document id of every token of the whole sequence [B, T] (`minidist.model.documents`):
        attention stays within each document (pass positions that restart at each document too). A `Documents`
        built from them is used as it is, with the masks it already holds: a pipeline builds one per micro-batch
        and hands it to each of its chunks, so that a GPU builds each micro-batch's BlockMask once, not per chunk.

        The keywords run a part of the model, for pipeline stages: only the blocks whose indices are in `blocks`
        (in that order; default all), with embed=False taking hidden states [B, T, d] instead of tokens and
        head=False returning hidden states instead of logits. A pipeline stage, which holds only some blocks,
        passes its own indices (they need not be consecutive: an interleaved stage owns several chunks).
        """
        if positions is None:
            positions = torch.arange(x.shape[1], device=x.device)
        if embed:
            x = self.tok_emb(x)
            if self.pos_emb is not None:
                x = x + self.pos_emb(positions)
        rope = self.rotary(positions) if self.rotary is not None else None
        documents = docs if isinstance(docs, Documents) or docs is None else Documents.build(docs)  # one per forward
        if documents is not None and documents.ids.shape[0] != x.shape[0]:
            raise ValueError(f"document ids for {documents.ids.shape[0]} rows, but the batch has {x.shape[0]}")
        run = range(len(self.blocks)) if blocks is None else blocks
        if documents is not None:  # built here, before the blocks: a compiled block only reads it
            cores = {id(m): m for i in run for m in self.blocks[i].modules() if hasattr(m, "prepare_documents")}
            for core in cores.values():
                core.prepare_documents(documents)
        for i in run:
            x = self.blocks[i](x, rope, documents)
        return self.lm_head(self.norm(x)) if head else x

    def aux_loss(self, blocks: Sequence[int] | None = None) -> torch.Tensor:
        """Sum of the auxiliary losses (MoE balancing) recorded by the last forward of the given blocks (default
        all); a 0 that requires no gradient when they hold no MoE layer."""
        modules = self.modules() if blocks is None else (m for i in blocks for m in self.blocks[i].modules())
        losses = [m.aux_loss for m in modules if isinstance(getattr(m, "aux_loss", None), torch.Tensor)]
        if not losses:
            return torch.zeros((), device=next(self.parameters()).device)
        return torch.stack(losses).sum()


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
            reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy over the non-ignored target positions, computed in fp32: their mean, or with
    reduction="sum" their sum (to divide by a token count taken over several micro-batches or ranks)."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index,
                           reduction=reduction)


def build_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Construct the model and give every parameter its layout-independent initial value."""
    model = Transformer(cfg)
    init_parameters(model, cfg, seed)
    return model
