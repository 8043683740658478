"""Chapter 05 exercises, answered: MLA decoding scores against the latent cache, and how long a context fits."""

import math
from fractions import Fraction

import torch

from minidist.model.config import ModelConfig


def _rotate_half_layout(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def mla_decode_scores(x: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, wq: torch.Tensor,
                      wkv_b: torch.Tensor, n_heads: int, qk_nope_head_dim: int, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
    """Scaled attention logits of new tokens against the latent cache (see exercises/ch05_attention.py)."""
    nope, rope, d_c = qk_nope_head_dim, k_rope.shape[-1], c_kv.shape[-1]
    w_q = wq.view(n_heads, nope + rope, -1)  # per head: [nope rows; rope rows]
    w_uk = wkv_b.view(n_heads, -1, d_c)[:, :nope]  # per head: the key half of [W_UK; W_UV]
    q_nope = torch.einsum("bti,hni->bhtn", x, w_q[:, :nope])
    # Absorption: q_nope · (W_UK c) = (W_UKᵀ q_nope) · c, so the query moves into the latent space instead of
    # every cached latent being expanded into per-head keys.
    q_latent = torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk)
    q_rope = _rotate_half_layout(torch.einsum("bti,hri->bhtr", x, w_q[:, nope:]), cos, sin)
    scores = torch.einsum("bhtc,bsc->bhts", q_latent, c_kv) + torch.einsum("bhtr,bsr->bhts", q_rope, k_rope)
    return scores / math.sqrt(nope + rope)


def max_cached_tokens(cfg: ModelConfig, memory_bytes: int, batch: int = 1, bytes_per_element: float = 2.0) -> int:
    """The longest context whose KV cache fits in `memory_bytes` (see exercises/ch05_attention.py)."""
    if cfg.attention == "mla":
        per_layer = cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim  # the latent and the shared rope key
    else:
        per_layer = 2 * cfg.n_kv_heads * cfg.head_dim  # a key and a value per kv head
    # Exact arithmetic: 0.75 bytes per element times a count must not round across an integer boundary.
    bytes_per_token = Fraction(bytes_per_element) * per_layer * cfg.n_layers * batch
    return math.floor(memory_bytes / bytes_per_token)
