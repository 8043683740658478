"""Chapter 01 exercises, answered: parameters and FLOPs of a mixture-of-experts model, and the days a run takes.

The notebook counts dense models; here the feed-forward of some blocks is a mixture of experts (chapter 06 builds
it), so "parameters" splits into what the model stores and what one token actually multiplies.
"""

from minidist.model.config import ModelConfig


def _attention_weights(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul weights, biases) of one GQA/MHA attention layer: W_q, W_o are d×HQ, W_k, W_v are d×H_kv·Q."""
    d, q, kv = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    biases = q + 2 * kv + d if cfg.bias else 0
    return 2 * d * q + 2 * d * kv, biases


def _dense_mlp(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul weights, biases) of one dense feed-forward layer."""
    d, f = cfg.d_model, cfg.d_ff
    if cfg.mlp == "gelu":
        return 2 * d * f, (f + d if cfg.bias else 0)
    return 3 * d * f, (2 * f + d if cfg.bias else 0)


def _moe_mlp(cfg: ModelConfig) -> tuple[int, int]:
    """(all, active) matmul weights of one MoE layer: router, routed SwiGLU experts, shared experts; no biases."""
    moe, d = cfg.moe, cfg.d_model
    per_expert = 3 * d * (moe.d_expert or cfg.d_ff)
    router = d * moe.n_experts
    shared = moe.n_shared_experts * per_expert
    return router + moe.n_experts * per_expert + shared, router + moe.top_k * per_expert + shared


def _mlp_weights(cfg: ModelConfig) -> tuple[int, int, int]:
    """Summed over all blocks: (all matmul weights, active matmul weights, biases) of the feed-forward layers."""
    stored = active = biases = 0
    for layer in range(cfg.n_layers):
        if cfg.moe.n_experts > 0 and layer >= cfg.moe.first_dense_layers:
            all_w, active_w = _moe_mlp(cfg)
            stored, active = stored + all_w, active + active_w
        else:
            w, b = _dense_mlp(cfg)
            stored, active, biases = stored + w, active + w, biases + b
    return stored, active, biases


def moe_param_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) parameters of `Transformer(cfg)` (see exercises/ch01_flops.py)."""
    d, layers = cfg.d_model, cfg.n_layers
    norm = d * (2 if cfg.norm == "layernorm" and cfg.bias else 1)  # a LayerNorm with bias has a gain and a bias
    attn_w, attn_b = _attention_weights(cfg)
    mlp_all, mlp_active, mlp_b = _mlp_weights(cfg)
    # Everything except the feed-forward weights is used by every token.
    common = (cfg.vocab_size * d  # token embedding
              + (cfg.max_seq_len * d if cfg.position == "learned" else 0)
              + layers * (attn_w + attn_b + 2 * norm) + mlp_b + norm  # two norms per block, one final
              + (0 if cfg.tie_embeddings else d * cfg.vocab_size))
    return common + mlp_all, common + mlp_active


def moe_flops_per_token(cfg: ModelConfig, seq_len: int) -> int:
    """Training FLOPs per token, 6·N_active + 12·L·H·Q·T (see exercises/ch01_flops.py)."""
    attn_w, _ = _attention_weights(cfg)
    _, mlp_active, _ = _mlp_weights(cfg)
    # The output projection is a d×V matmul for every token, tied to the embedding or not.
    n_active = cfg.n_layers * attn_w + mlp_active + cfg.d_model * cfg.vocab_size
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * seq_len
    return 6 * n_active + attention


def training_days(n_params: float, n_tokens: float, n_gpus: int, flops_per_gpu: float,
                  recompute: bool = False) -> float:
    """Wall-clock days of a training run (see exercises/ch01_flops.py)."""
    # Forward 2, backward 4 FLOPs per parameter and token; recomputing activations runs the forward once more.
    flops_per_param_token = 8 if recompute else 6
    seconds = flops_per_param_token * n_params * n_tokens / (n_gpus * flops_per_gpu)
    return seconds / 86400
