"""KV-cache accounting (chapter 05) and the latent cache MLA decodes with.

A decoder keeps, for every past token and every layer, whatever its attention needs to score a new query:

    MHA   keys and values of every head            2·n_h·d_h      (Vaswani et al. 2017)
    GQA   keys and values of n_g head groups       2·n_g·d_h      (Ainslie et al. 2023, "GQA")
    MQA   one key head and one value head          2·d_h          (Shazeer 2019, "Fast Transformer Decoding")
    MLA   the latent c_KV and the shared rope key  d_c + d_h^R    (DeepSeek-AI 2024, "DeepSeek-V2", Table 1)

numbers per token per layer; times n_layers for the whole model, times bytes per element for memory.
"""

from __future__ import annotations

import torch

from minidist.model.config import ModelConfig


def attention_kind(cfg: ModelConfig) -> str:
    """ "MHA", "GQA", "MQA" or "MLA", from the config."""
    if cfg.attention == "mla":
        return "MLA"
    if cfg.n_kv_heads == cfg.n_heads:
        return "MHA"
    return "MQA" if cfg.n_kv_heads == 1 else "GQA"


def kv_cache_elements_per_token_per_layer(cfg: ModelConfig) -> int:
    """Numbers cached per token in one layer (Table 1 of DeepSeek-V2 without the factor l)."""
    if cfg.attention == "mla":
        return cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim
    return 2 * cfg.n_kv_heads * cfg.head_dim


def kv_cache_elements_per_token(cfg: ModelConfig) -> int:
    """Numbers cached per token over all layers."""
    return kv_cache_elements_per_token_per_layer(cfg) * cfg.n_layers


def kv_cache_bytes(cfg: ModelConfig, tokens: int = 1, batch: int = 1, bytes_per_element: float = 2.0) -> float:
    """Bytes of KV cache for `batch` sequences of `tokens` tokens (2 bytes per element: bf16/fp16)."""
    if tokens < 0 or batch < 0 or bytes_per_element <= 0:
        raise ValueError(f"need tokens >= 0, batch >= 0, bytes_per_element > 0; got {tokens}, {batch}, "
                         f"{bytes_per_element}")
    return kv_cache_elements_per_token(cfg) * tokens * batch * bytes_per_element


class LatentKVCache:
    """MLA's decoding cache: normalized latents c_KV [B, S, kv_rank] and rotated shared rope keys [B, S, rope]."""

    def __init__(self) -> None:
        self.c_kv: torch.Tensor | None = None
        self.k_rope: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.c_kv is None else self.c_kv.shape[1]

    def append(self, c_kv: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new tokens' entries; return everything cached so far."""
        if self.c_kv is None:
            self.c_kv, self.k_rope = c_kv, k_rope
        else:
            self.c_kv = torch.cat((self.c_kv, c_kv), dim=1)
            self.k_rope = torch.cat((self.k_rope, k_rope), dim=1)
        return self.c_kv, self.k_rope

    def numel_per_token(self) -> int:
        return 0 if self.c_kv is None else self.c_kv.shape[-1] + self.k_rope.shape[-1]
