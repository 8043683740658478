"""Hugging Face Llama checkpoints <-> minidist models, in memory: the config, the parameter names and the RoPE layout.

`to_hf_state(model_cfg, state)` gives the config.json values and the tensors of a `LlamaForCausalLM` that computes
the same logits as `Transformer(model_cfg)` holding `state`; `from_hf_state(hf_config, hf_state)` is its inverse.
Both are gathers of the same numbers: minidist -> HF -> minidist is bit for bit the same state.

Hugging Face's Llama rotates each (i, i + d/2) pair of a head ("half" layout, `rotate_half`); a minidist model may
store its heads in the "interleaved" layout (pairs (2i, 2i+1), Meta's original Llama). Chapter 03's permutation p
(`interleaved_to_half_permutation`) converts one into the other: applied to the output rows of W_q and W_k of every
head it leaves every score q·k unchanged, since both vectors are permuted the same way.

What a Llama-family config may hold is checked value by value; what minidist does not compute is refused in one
line (`ConvertError`): biases, other activations, attention dropout, RoPE types other than default, linear and YaRN
(with its default attention factor), partial rotary, a head_dim other than hidden_size / num_attention_heads.
Keys that do not change the function (token ids, dtype, generation settings) are metadata and not read.
"""

from __future__ import annotations

from typing import Any

import torch

from minidist.model.config import ModelConfig
from minidist.model.hf_config import HFConfigError, llama_config
from minidist.model.rope import interleaved_to_half_permutation


class ConvertError(ValueError):
    """Input a conversion cannot use; the message is one line saying what is wrong and what would fit."""


# minidist name -> HF name, outside the blocks and inside block i (model.layers.i.*)
TOP_NAMES = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
BLOCK_NAMES = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
               "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
               "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
               "mlp.w1.weight": "mlp.gate_proj.weight", "mlp.w3.weight": "mlp.up_proj.weight",
               "mlp.w2.weight": "mlp.down_proj.weight"}
ROTATED = ("attn.wq.weight", "attn.wk.weight")  # output rows in the RoPE layout
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Older checkpoints stored this derived buffer; it is recomputed from the config, so it is skipped.
DERIVED_SUFFIX = ".self_attn.rotary_emb.inv_freq"


def hf_name(name: str) -> str:
    if name.startswith("blocks."):
        _, i, rest = name.split(".", 2)
        return f"model.layers.{i}.{BLOCK_NAMES[rest]}"
    return TOP_NAMES[name]


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{minidist name: shape} of every tensor of a Llama-family model (lm_head too, even when tied)."""
    d, hd, ff = cfg.d_model, cfg.head_dim, cfg.d_ff
    shapes = {"tok_emb.weight": (cfg.vocab_size, d), "norm.weight": (d,), "lm_head.weight": (cfg.vocab_size, d)}
    block = {"attn_norm.weight": (d,), "mlp_norm.weight": (d,), "attn.wq.weight": (cfg.n_heads * hd, d),
             "attn.wk.weight": (cfg.n_kv_heads * hd, d), "attn.wv.weight": (cfg.n_kv_heads * hd, d),
             "attn.wo.weight": (d, cfg.n_heads * hd), "mlp.w1.weight": (ff, d), "mlp.w3.weight": (ff, d),
             "mlp.w2.weight": (d, ff)}
    for i in range(cfg.n_layers):
        shapes.update({f"blocks.{i}.{k}": v for k, v in block.items()})
    return shapes


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """`expected_shapes` under the HF names: what a Llama checkpoint of `cfg` holds (lm_head too, even when tied)."""
    return {hf_name(name): shape for name, shape in expected_shapes(cfg).items()}


def _permute_heads(w: torch.Tensor, head_dim: int, perm: torch.Tensor) -> torch.Tensor:
    """Reorder the output rows of every head of a [heads·head_dim, d] weight by `perm` (a gather: exact)."""
    return w.reshape(-1, head_dim, w.shape[-1])[:, perm, :].reshape(w.shape)


# ---------------------------------------------------------------------------------------------------------------
# minidist -> HF


def check_llama_family(cfg: ModelConfig) -> None:
    """One-line ConvertError unless HF's LlamaForCausalLM computes what a model of `cfg` computes."""
    cfg.validate()
    wanted = {"mlp": "swiglu", "norm": "rmsnorm", "position": "rope", "attention": "gqa", "bias": False}
    for key, value in wanted.items():
        if getattr(cfg, key) != value:
            raise ConvertError(f"model {key}={getattr(cfg, key)!r} has no Llama counterpart; a Llama-family model "
                               f"has {', '.join(f'{k}={v!r}' for k, v in wanted.items())}")
    if cfg.moe.n_experts:
        raise ConvertError(f"a mixture-of-experts model (n_experts={cfg.moe.n_experts}) is not a Llama; "
                           "only dense models convert")
    if cfg.rope_scaling.kind not in ("none", "linear", "yarn"):
        raise ConvertError(f"rope scaling {cfg.rope_scaling.kind!r} has no HF Llama rope_type; "
                           "none, linear and yarn convert")


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json values of the LlamaForCausalLM that computes what a model of `cfg` computes (fp32 weights)."""
    check_llama_family(cfg)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(cfg.rope_base)}
    scaling = cfg.rope_scaling
    if scaling.kind == "linear":
        rope.update(rope_type="linear", factor=float(scaling.factor))
    elif scaling.kind == "yarn":
        rope.update(rope_type="yarn", factor=float(scaling.factor),
                    original_max_position_embeddings=scaling.original_max_seq_len,
                    beta_fast=float(scaling.beta_fast), beta_slow=float(scaling.beta_slow))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff, "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": float(cfg.norm_eps),
        "tie_word_embeddings": bool(cfg.tie_embeddings), "rope_parameters": rope, "hidden_act": "silu",
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "pretraining_tp": 1,
        "initializer_range": float(cfg.init_std), "dtype": "float32",
    }


def to_hf_state(model_cfg: ModelConfig, state: dict[str, torch.Tensor]) -> tuple[dict[str, Any],
                                                                                  dict[str, torch.Tensor]]:
    """(config.json values, {HF name: tensor}) for a minidist model's full state (one-process names).

    With tied embeddings `lm_head.weight` may be absent from `state` (it is the embedding) and is left out of the
    HF state, as transformers saves it. q and k are permuted to HF's layout when the model is "interleaved".
    """
    config = hf_config(model_cfg)
    shapes = expected_shapes(model_cfg)
    state = dict(state)
    if model_cfg.tie_embeddings and "lm_head.weight" in state:
        if "tok_emb.weight" in state and not torch.equal(state["lm_head.weight"], state["tok_emb.weight"]):
            raise ConvertError("the model ties its embeddings but lm_head.weight differs from tok_emb.weight")
        del state["lm_head.weight"]
    if model_cfg.tie_embeddings:
        del shapes["lm_head.weight"]
    _check_names(state, shapes, "the minidist state")
    perm = interleaved_to_half_permutation(model_cfg.head_dim) if model_cfg.rope_layout == "interleaved" else None
    out = {}
    for name, value in state.items():
        _check_tensor(name, value, shapes[name])
        if perm is not None and name.endswith(ROTATED):
            value = _permute_heads(value, model_cfg.head_dim, perm)
        out[hf_name(name)] = value.detach().contiguous()
    return config, out


# ---------------------------------------------------------------------------------------------------------------
# HF -> minidist


def model_config_from_hf(config: dict[str, Any], rope_layout: str = "half") -> ModelConfig:
    """The minidist ModelConfig of a Llama-family config.json (`model.hf_config.llama_config`: every value checked,
    hostile sizes capped); one-line ConvertError for anything else."""
    try:
        return llama_config(config, rope_layout)
    except HFConfigError as e:
        raise ConvertError(str(e)) from None


def from_hf_state(hf_config_dict: dict[str, Any], hf_state: dict[str, torch.Tensor], rope_layout: str = "half"
                  ) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, {minidist name: fp32 tensor}) of a Llama checkpoint: names, shapes, dtypes and finiteness
    checked against what the config implies; missing or extra tensors refused in one line. `lm_head.weight` is
    in the result also when tied (as in `Transformer.state_dict()`). `rope_layout` is the layout the minidist
    model will store its heads in (HF's is "half": no permutation)."""
    cfg = model_config_from_hf(hf_config_dict, rope_layout)
    shapes = hf_shapes(cfg)
    hf_state = {k: v for k, v in hf_state.items() if not (isinstance(k, str) and k.endswith(DERIVED_SUFFIX))}
    if cfg.tie_embeddings:
        lm_head = hf_state.pop("lm_head.weight", None)
        embedding = hf_state.get("model.embed_tokens.weight")
        if lm_head is not None and embedding is not None and not torch.equal(lm_head, embedding):
            raise ConvertError("config.json ties the embeddings (tie_word_embeddings) but lm_head.weight differs "
                               "from model.embed_tokens.weight; set tie_word_embeddings false to keep both")
        del shapes["lm_head.weight"]
    _check_names(hf_state, shapes, "the checkpoint", hint=" (untied embeddings need lm_head.weight; "
                 "tie_word_embeddings true shares model.embed_tokens.weight)" if not cfg.tie_embeddings else "")
    back = {hf_name(name): name for name in expected_shapes(cfg)}
    perm = interleaved_to_half_permutation(cfg.head_dim) if rope_layout == "interleaved" else None
    state = {}
    for name, value in hf_state.items():
        _check_tensor(name, value, shapes[name])
        ours = back[name]
        value = value.detach().to(torch.float32)
        if perm is not None and ours.endswith(ROTATED):
            value = _permute_heads(value, cfg.head_dim, torch.argsort(perm))
        state[ours] = value.contiguous()
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return cfg, state


# ---------------------------------------------------------------------------------------------------------------
# checks


def _check_names(state: dict, shapes: dict, what: str, hint: str = "") -> None:
    bad_keys = [k for k in state if not isinstance(k, str)]
    if bad_keys:
        raise ConvertError(f"{what} has non-string tensor names, e.g. {bad_keys[0]!r}")
    missing, extra = sorted(set(shapes) - set(state)), sorted(set(state) - set(shapes))
    if missing or extra:
        parts = [f"{len(missing)} missing (e.g. {missing[:3]})"] if missing else []
        parts += [f"{len(extra)} unexpected (e.g. {extra[:3]})"] if extra else []
        raise ConvertError(f"{what} does not hold the tensors its config implies: {'; '.join(parts)}{hint}")


def _check_tensor(name: str, value: Any, shape: tuple[int, ...]) -> None:
    if not isinstance(value, torch.Tensor):
        raise ConvertError(f"{name} is a {type(value).__name__}, not a tensor")
    if tuple(value.shape) != shape:
        raise ConvertError(f"{name} has shape {list(value.shape)}; the config implies {list(shape)}")
    if value.dtype not in FLOAT_DTYPES:
        raise ConvertError(f"{name} has dtype {value.dtype}; weights must be float32, bfloat16 or float16")
    if not bool(torch.isfinite(value).all()):
        raise ConvertError(f"{name} holds NaN or infinite values")
