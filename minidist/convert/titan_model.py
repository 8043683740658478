"""minidist models <-> torchtitan's Llama 3, in memory: the parameter names and the RoPE layout.

torchtitan (0.3.0) names a Llama 3 model's parameters as its `Llama3StateDictAdapter` maps them to Hugging Face's:

    tok_emb.weight                 tok_embeddings.weight
    blocks.i.attn_norm.weight      layers.i.attention_norm.weight
    blocks.i.attn.wq.weight        layers.i.attention.qkv_linear.wq.weight      (wk, wv the same)
    blocks.i.attn.wo.weight        layers.i.attention.wo.weight
    blocks.i.mlp_norm.weight       layers.i.ffn_norm.weight
    blocks.i.mlp.w1.weight         layers.i.feed_forward.w1.weight              (w2, w3 the same)
    norm.weight, lm_head.weight    the same

and rotates each (2i, 2i+1) pair of a head (complex RoPE: the "interleaved" layout, Meta's original Llama). A
minidist model in the "half" layout (pairs (i, i + d/2), its default and Hugging Face's) has the output rows of
W_q and W_k of every head permuted on the way: `interleaved_to_half_permutation` p gives x_half = x_interleaved[p],
so x_interleaved = x_half[argsort(p)]. The same gather applies to Adam's moments of those weights (element-wise
state follows its element). Both directions are gathers: minidist -> torchtitan -> minidist is bit for bit.
"""

from __future__ import annotations

import torch

from minidist.convert.hf_model import BLOCK_NAMES, ROTATED, ConvertError, _permute_heads, check_llama_family
from minidist.model.config import ModelConfig
from minidist.model.rope import interleaved_to_half_permutation

TOP = {"tok_emb.weight": "tok_embeddings.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
BLOCK = {"attn_norm.weight": "attention_norm.weight", "mlp_norm.weight": "ffn_norm.weight",
         "attn.wq.weight": "attention.qkv_linear.wq.weight", "attn.wk.weight": "attention.qkv_linear.wk.weight",
         "attn.wv.weight": "attention.qkv_linear.wv.weight", "attn.wo.weight": "attention.wo.weight",
         "mlp.w1.weight": "feed_forward.w1.weight", "mlp.w2.weight": "feed_forward.w2.weight",
         "mlp.w3.weight": "feed_forward.w3.weight"}
assert set(BLOCK) == set(BLOCK_NAMES)  # the same tensors as the Hugging Face conversion
FROM_TOP = {v: k for k, v in TOP.items()}
FROM_BLOCK = {v: k for k, v in BLOCK.items()}


def titan_name(name: str) -> str:
    """torchtitan's name of a minidist parameter (one-process names)."""
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        return f"layers.{i}.{BLOCK[rest]}"
    if name not in TOP:
        raise ConvertError(f"{name} has no torchtitan Llama 3 counterpart")
    return TOP[name]


def minidist_name(name: str) -> str:
    """minidist's name of a torchtitan Llama 3 parameter."""
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        if rest in FROM_BLOCK and i.isdigit():
            return f"blocks.{int(i)}.{FROM_BLOCK[rest]}"
    elif name in FROM_TOP:
        return FROM_TOP[name]
    raise ConvertError(f"{name} is not a torchtitan Llama 3 parameter (e.g. layers.0.attention.qkv_linear.wq.weight)")


def rope_rows(cfg: ModelConfig, to_titan: bool) -> torch.Tensor | None:
    """The gather of each head's rows of W_q, W_k (and their moments) from minidist's layout to torchtitan's
    (`to_titan`) or back; None when the model is already interleaved."""
    if cfg.rope_layout == "interleaved":
        return None
    p = interleaved_to_half_permutation(cfg.head_dim)
    return torch.argsort(p) if to_titan else p


def to_titan(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{torchtitan name: tensor} of a minidist Llama-family state (a parameter's value or any element-wise state
    of it, keyed by the minidist name); an untied copy of the head when the model ties it (torchtitan keeps both)."""
    check_llama_family(cfg)
    rows = rope_rows(cfg, to_titan=True)
    out = {}
    for name, value in state.items():
        if rows is not None and name.endswith(ROTATED) and value.dim() == 2:  # not a scalar (Adam's step)
            value = _permute_heads(value, cfg.head_dim, rows)
        out[titan_name(name)] = value.detach().contiguous()
    return out


def from_titan(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `to_titan`: {minidist name: tensor} in `cfg.rope_layout`."""
    rows = rope_rows(cfg, to_titan=False)
    out = {}
    for name, value in state.items():
        mine = minidist_name(name)
        if rows is not None and mine.endswith(ROTATED) and value.dim() == 2:
            value = _permute_heads(value, cfg.head_dim, rows)
        out[mine] = value
    return out
