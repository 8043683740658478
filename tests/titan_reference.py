"""torchtitan 0.3.0's own Llama 3 built with a minidist run's shapes (the reference of tests/test_native.py's
torchtitan test; imported only when torchtitan is installed: the `titan` extra)."""

from __future__ import annotations

from pathlib import Path

import torch

from minidist.convert import dcp as dcp_convert
from minidist.convert import titan_model
from minidist.model import ModelConfig, build_model
from minidist.train.config import config_from_values
from minidist.train.config import model_config as trainer_model_config


def model_config(dcp_dir: Path) -> ModelConfig:
    return trainer_model_config(config_from_values(dcp_convert.read_run_file(dcp_dir)))


def build_titan(cfg: ModelConfig):
    """torchtitan's Llama3Model for `cfg`: unfused q/k/v (its checkpoint names), complex (interleaved) RoPE."""
    import torchtitan.models.llama3 as llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    d, vocab = cfg.d_model, cfg.vocab_size
    norm = dict(normalized_shape=d, param_init=llama3._NORM_INIT, eps=cfg.norm_eps)
    layers = llama3._build_llama3_layers(
        fuse_qkv=False, n_layers=cfg.n_layers, dim=d, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
        hidden_dim=cfg.d_ff, attn_backend="flex",
        rope=ComplexRoPE.Config(dim=cfg.head_dim, max_seq_len=cfg.max_seq_len, theta=float(cfg.rope_base)))
    for layer in layers:
        layer.attention_norm.eps = layer.ffn_norm.eps = cfg.norm_eps
    config = llama3.Llama3Model.Config(
        dim=d, vocab_size=vocab, layers=layers, norm=RMSNorm.Config(**norm),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=d, param_init=llama3._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=d, out_features=vocab, param_init=llama3._output_linear_init(d)))
    return config.build()


def logits_both(dcp_dir: Path, state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(torchtitan's logits, minidist's) for the same tokens, each model holding the exported weights."""
    cfg = model_config(dcp_dir)
    titan = build_titan(cfg)
    titan.load_state_dict({k: state[k] for k in titan.state_dict()}, strict=True)
    mine = build_model(cfg, seed=0)
    weights = {titan_model.titan_name(n): None for n, _ in mine.named_parameters()}
    mine.load_state_dict(titan_model.from_titan(cfg, {k: state[k] for k in weights}))
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    from torch.nn.attention.flex_attention import create_block_mask

    causal = create_block_mask(lambda b, h, q, k: q >= k, None, None, tokens.shape[1], tokens.shape[1], device="cpu")
    with torch.no_grad():  # a causal mask built directly: torchtitan's own compiles it (13 s on this CPU)
        got = titan(tokens, positions, causal)
        want = mine(tokens)
    return got, want
