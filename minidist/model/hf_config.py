"""A Hugging Face `config.json` read as a `ModelConfig`, as untrusted input: every value checked, every size capped.

Two readers share the checks. `llama_config` is the strict one a checkpoint conversion needs (`convert/`): only a
Llama, and only what minidist computes exactly (its RoPE scaling included). `planned_config` is the one the layout
planner needs (`plan/`): the shapes that set memory and FLOPs, for Llama- and Mistral-style dense models and
DeepSeek-V3-style models (multi-head latent attention, routed and shared experts, the first blocks dense). Keys that
do not change the architecture (token ids, dtype, generation and routing-group settings, `transformers_version`) are
not read; a key that would change it and is not modelled is refused in one line, not counted: a Mistral sliding
window (attention over the last W keys only), Qwen2's q/k/v biases (every `qwen2` config has them), other
activations, biases, a head_dim other than hidden_size / num_attention_heads. RoPE's base and scaling change no shape
or FLOP count: the planner does not read them.

Hostile sizes (10^12 layers, a vocabulary of 10^15) are refused before anything is built or counted (`check_sizes`).
"""

from __future__ import annotations

import math
from typing import Any

from minidist.model.config import MLAConfig, ModelConfig, MoEConfig, RopeScalingConfig


class HFConfigError(ValueError):
    """A config.json minidist cannot use; the message is one line saying what is wrong and what would fit."""


MAX_LAYERS = 4096
# Caps far above any published model (Llama 3.1 405B: width 16,384, FFN 53,248, 128 heads, vocab 128,256; DeepSeek-V3:
# 256 experts; Gemma: vocab 256,000): a config beyond them is hostile or a typo, refused before any count or build.
MAX_SIZES = {"vocab_size": 1 << 24, "d_model": 1 << 18, "d_ff": 1 << 20, "n_heads": 1 << 12, "n_kv_heads": 1 << 12,
             "max_seq_len": 1 << 24, "n_layers": MAX_LAYERS}
MAX_EXPERTS = 1 << 14


def check_sizes(cfg: ModelConfig, where: str = "model") -> ModelConfig:
    """`cfg` validated, after a one-line HFConfigError for a size beyond `MAX_SIZES` (a hostile config: checked
    before `validate`, whose error messages list divisors)."""
    sizes = {name: getattr(cfg, name) for name in MAX_SIZES}
    sizes.update(n_experts=cfg.moe.n_experts, d_expert=cfg.moe.d_expert or 0, top_k=cfg.moe.top_k,
                 n_shared_experts=cfg.moe.n_shared_experts)
    caps = {**MAX_SIZES, "n_experts": MAX_EXPERTS, "d_expert": MAX_SIZES["d_ff"], "top_k": MAX_EXPERTS,
            "n_shared_experts": MAX_EXPERTS}
    if cfg.attention == "mla":
        m = cfg.mla
        sizes.update(kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank or 0, qk_nope_head_dim=m.qk_nope_head_dim,
                     qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim)
        caps.update(dict.fromkeys(("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                   "v_head_dim"), MAX_SIZES["d_model"]))
    for name, value in sizes.items():
        if type(value) is not int:
            raise HFConfigError(f"{where} {name} must be a whole number, got {value!r}")
        if value > caps[name]:
            raise HFConfigError(f"{where} {name}={value:,} is more than {caps[name]:,}; no trained model is that large "
                                "(Llama 3.1 405B: 126 layers, width 16,384)")
    try:
        return cfg.validate()
    except ValueError as e:
        raise HFConfigError(f"{where} does not make a valid model: {e}") from None


def _positive_int(config: dict, key: str, default: Any = None) -> int:
    value = config.get(key, default)
    if type(value) is not int or value < 1:
        raise HFConfigError(f"config.json {key} must be a positive integer, got {value!r}")
    return value


def _positive_float(config: dict, key: str, default: Any = None, where: str = "config.json") -> float:
    value = config.get(key, default)
    if type(value) not in (int, float) or not math.isfinite(value) or value <= 0:
        raise HFConfigError(f"{where} {key} must be a positive finite number, got {value!r}")
    return float(value)


def _rope_parameters(config: dict) -> dict[str, Any]:
    """transformers 5 writes `rope_parameters`; 4.x wrote `rope_theta` and `rope_scaling` (None or a dict)."""
    params = config.get("rope_parameters")
    if params is None:
        scaling = config.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise HFConfigError(f"config.json rope_scaling must be null or an object, got {scaling!r}")
        params = {"rope_theta": config.get("rope_theta", 10000.0), **(scaling or {})}
    if not isinstance(params, dict):
        raise HFConfigError(f"config.json rope_parameters must be an object, got {params!r}")
    return params


def _rope_scaling(config: dict, params: dict[str, Any]) -> RopeScalingConfig:
    kind = params.get("rope_type", params.get("type", "default"))
    known = {"default": set(), "linear": {"factor"},
             "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate"}}
    if kind not in known:
        raise HFConfigError(f"config.json rope_type {kind!r} is not supported; minidist computes {sorted(known)}")
    extra = sorted(set(params) - known[kind] - {"rope_type", "type", "rope_theta"})
    if params.get("partial_rotary_factor", 1.0) == 1.0:  # the full head rotated: what minidist does
        extra = [k for k in extra if k != "partial_rotary_factor"]
    if extra:  # attention_factor, mscale, ...: a function minidist does not compute
        raise HFConfigError(f"config.json rope parameters {extra} are not supported for rope_type {kind!r}; "
                            f"supported: {sorted(known[kind]) or 'none besides rope_theta'}")
    where = "config.json rope parameter"
    if kind == "default":
        return RopeScalingConfig()
    factor = _positive_float(params, "factor", where=where)
    if factor < 1.0:
        raise HFConfigError(f"{where} factor must be >= 1 (it stretches the context), got {factor}")
    if kind == "linear":
        return RopeScalingConfig(kind="linear", factor=factor)
    if params.get("truncate", True) is not True:
        raise HFConfigError("config.json rope parameter truncate=false is not supported (minidist floors and ceils "
                            "YaRN's correction range, truncate=true)")
    original = params.get("original_max_position_embeddings", config.get("max_position_embeddings"))
    if type(original) is not int or original < 1:
        raise HFConfigError(f"{where} original_max_position_embeddings must be a positive integer, got {original!r}")
    # transformers reads a beta of 0 or null as its default (`or 32`), and so does this.
    beta_fast = _positive_float(params, "beta_fast", where=where) if params.get("beta_fast") else 32.0
    beta_slow = _positive_float(params, "beta_slow", where=where) if params.get("beta_slow") else 1.0
    return RopeScalingConfig(kind="yarn", factor=factor, original_max_seq_len=original, beta_fast=beta_fast,
                             beta_slow=beta_slow)


def _refuse(config: dict, fits: dict[str, Any], why: str = "is not modelled (refused, not counted)") -> None:
    """One-line HFConfigError for the first key present with a value other than the one minidist computes."""
    for key, value in fits.items():
        if key in config and config[key] != value:
            raise HFConfigError(f"config.json {key}={config[key]!r} {why}; minidist's model has {key}={value!r}")


def _dense_fields(config: dict) -> dict[str, Any]:
    """The ModelConfig fields every family shares: sizes (capped), heads, tied embeddings."""
    if not isinstance(config, dict):
        raise HFConfigError(f"config.json must hold a JSON object, got {type(config).__name__}")
    ints = {key: _positive_int(config, key) for key in ("vocab_size", "hidden_size", "intermediate_size",
                                                        "num_hidden_layers", "num_attention_heads",
                                                        "max_position_embeddings")}
    if ints["num_hidden_layers"] > MAX_LAYERS:  # the names a config implies are listed before any file is read
        raise HFConfigError(f"config.json num_hidden_layers={ints['num_hidden_layers']} is more than {MAX_LAYERS}; "
                            "no Llama has that many (Llama 3.1 405B has 126)")
    heads = ints["num_attention_heads"]
    kv_heads = _positive_int(config, "num_key_value_heads", heads)
    if ints["hidden_size"] % heads or heads % kv_heads:
        raise HFConfigError(f"config.json heads do not divide: hidden_size {ints['hidden_size']}, "
                            f"num_attention_heads {heads}, num_key_value_heads {kv_heads} (need heads | hidden_size "
                            "and key-value heads | heads)")
    tied = config.get("tie_word_embeddings", False)  # LlamaConfig's default when the key is absent
    if type(tied) is not bool:
        raise HFConfigError(f"config.json tie_word_embeddings must be true or false, got {tied!r}")
    return dict(vocab_size=ints["vocab_size"], d_model=ints["hidden_size"], n_layers=ints["num_hidden_layers"],
                n_heads=heads, n_kv_heads=kv_heads, d_ff=ints["intermediate_size"],
                max_seq_len=ints["max_position_embeddings"], tie_embeddings=tied,
                norm_eps=_positive_float(config, "rms_norm_eps", 1e-6),
                init_std=_positive_float(config, "initializer_range", 0.02))


def _check_head_dim(config: dict, fields: dict[str, Any]) -> None:
    derived = fields["d_model"] // fields["n_heads"]
    head_dim = config.get("head_dim") or derived
    if head_dim != derived or head_dim % 2:
        raise HFConfigError(f"config.json head_dim {head_dim!r} is not supported; minidist needs head_dim = "
                            f"hidden_size / num_attention_heads = {derived}, even")


def llama_config(config: dict[str, Any], rope_layout: str = "half") -> ModelConfig:
    """The minidist ModelConfig of a Llama-family config.json, exactly (RoPE included: a conversion needs the
    function, not only the shapes); one-line HFConfigError for anything else."""
    if not isinstance(config, dict):
        raise HFConfigError(f"config.json must hold a JSON object, got {type(config).__name__}")
    if config.get("model_type") != "llama":
        raise HFConfigError(f"config.json model_type is {config.get('model_type')!r}; only Llama-family checkpoints "
                            "(model_type 'llama', LlamaForCausalLM) convert")
    architectures = config.get("architectures", ["LlamaForCausalLM"])
    if architectures != ["LlamaForCausalLM"]:
        raise HFConfigError(f"config.json architectures is {architectures!r}; only ['LlamaForCausalLM'] converts")
    _refuse(config, {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1,
                     "attention_dropout": 0.0}, "is not supported")
    if rope_layout not in ("half", "interleaved"):
        raise HFConfigError(f"rope layout {rope_layout!r} is unknown; choose half or interleaved")
    fields = _dense_fields(config)
    _check_head_dim(config, fields)
    params = _rope_parameters(config)
    base = _positive_float(params, "rope_theta", 10000.0, where="config.json rope parameter")
    if base <= 1.0:
        raise HFConfigError(f"config.json rope_theta must be > 1, got {base}")
    cfg = ModelConfig(**fields, rope_base=base, rope_layout=rope_layout, rope_scaling=_rope_scaling(config, params))
    return check_sizes(cfg, "config.json")


PLANNED_FAMILIES = ("llama", "mistral", "deepseek_v3")


def planned_config(config: dict[str, Any]) -> tuple[ModelConfig, int]:
    """(the ModelConfig of a config.json's shapes, its multi-token-prediction modules): Llama- and Mistral-style
    dense models and DeepSeek-V3-style MoE + MLA ones (`PLANNED_FAMILIES`); one-line HFConfigError for the rest."""
    if not isinstance(config, dict):
        raise HFConfigError(f"config.json must hold a JSON object, got {type(config).__name__}")
    family = config.get("model_type")
    if family == "qwen2":
        raise HFConfigError("config.json model_type 'qwen2': its q/k/v projections carry biases, which minidist's "
                            "model does not have (refused, not counted); plan it as a Llama (model_type 'llama') "
                            "to leave them out")
    if family not in PLANNED_FAMILIES:
        raise HFConfigError(f"config.json model_type {family!r} is not modelled; the planner reads "
                            f"{', '.join(PLANNED_FAMILIES)} configs, or a minidist TOML model table")
    _refuse(config, {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0})
    if config.get("sliding_window") is not None and config.get("use_sliding_window", True):
        raise HFConfigError(f"config.json sliding_window={config['sliding_window']!r}: sliding-window attention is "
                            "not modelled (refused, not counted); set it to null to plan full causal attention")
    fields = _dense_fields(config)
    if family != "deepseek_v3":
        _check_head_dim(config, fields)
        return check_sizes(ModelConfig(**fields), "config.json"), 0
    return _deepseek(config, fields)


def _deepseek(config: dict[str, Any], fields: dict[str, Any]) -> tuple[ModelConfig, int]:
    """DeepSeek-V3's MLA and MoE fields (`DeepseekV3Config`)."""
    if fields["n_kv_heads"] != fields["n_heads"]:
        raise HFConfigError(f"config.json num_key_value_heads={fields['n_kv_heads']} with MLA: latent attention has "
                            f"one key and value per head (num_attention_heads={fields['n_heads']})")
    _refuse(config, {"moe_layer_freq": 1})  # every block after the dense ones an MoE block
    q_rank = config.get("q_lora_rank")
    mla = MLAConfig(q_lora_rank=None if q_rank is None else _positive_int(config, "q_lora_rank"),
                    **{k: _positive_int(config, k) for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                             "v_head_dim")})
    experts = config.get("n_routed_experts") or 0
    if type(experts) is not int or experts < 0:
        raise HFConfigError(f"config.json n_routed_experts must be a whole number >= 0, got {experts!r}")
    moe = MoEConfig()
    if experts:
        scoring = config.get("scoring_func", "softmax")
        if scoring not in ("softmax", "sigmoid"):
            raise HFConfigError(f"config.json scoring_func={scoring!r} is not modelled; softmax or sigmoid")
        moe = MoEConfig(n_experts=experts, top_k=_positive_int(config, "num_experts_per_tok"),
                        n_shared_experts=config.get("n_shared_experts") or 0,
                        d_expert=_positive_int(config, "moe_intermediate_size"), router=scoring,
                        first_dense_layers=config.get("first_k_dense_replace", 0),
                        routed_scaling_factor=_positive_float(config, "routed_scaling_factor", 1.0))
        for key in ("n_shared_experts", "first_dense_layers"):
            if type(getattr(moe, key)) is not int or getattr(moe, key) < 0:
                raise HFConfigError(f"config.json {key} must be a whole number >= 0, got {getattr(moe, key)!r}")
    mtp = config.get("num_nextn_predict_layers", 0)
    if type(mtp) is not int or not 0 <= mtp <= 8:
        raise HFConfigError(f"config.json num_nextn_predict_layers must be a whole number in 0..8, got {mtp!r}")
    cfg = ModelConfig(**fields, attention="mla", mla=mla, moe=moe)
    return check_sizes(cfg, "config.json"), mtp
