"""Chapter 05 exercises: MLA decoding scores against the latent cache, and the longest context a memory holds.

Grade your answers with `make grade CH=05`. The grader compares your scores with the naive ones (per-head keys
rebuilt from the latents, DeepSeek-V2 eqs. 9-18), counts the FLOPs of your function with FlopCounterMode (it
must not rebuild those keys), and checks your context lengths with `minidist.model.kv_cache.kv_cache_bytes`.

The notebook absorbs W_UK for DeepSeek-V2's shape, with compressed queries (wq_a, q_norm, wq_b) and over a whole
prompt. Here the queries are not compressed (DeepSeek-V2-Lite's shape: one matrix wq) and the keys come only
from the cache, as in decoding. Weight layouts (rows = output features, as in torch.nn.Linear):
  wq     [H·(nope + rope), d_model]   per head h, rows h·(nope+rope) .. : first nope rows, then rope rows
  wkv_b  [H·(nope + v), kv_rank]      per head h: first nope rows (W_UK,h), then v rows (W_UV,h)
"""

import torch

from minidist.model.config import ModelConfig


def mla_decode_scores(x: torch.Tensor, c_kv: torch.Tensor, k_rope: torch.Tensor, wq: torch.Tensor,
                      wkv_b: torch.Tensor, n_heads: int, qk_nope_head_dim: int, cos: torch.Tensor,
                      sin: torch.Tensor) -> torch.Tensor:
    """Scaled attention logits [B, H, T, S] of T new tokens against S cached tokens, through weight absorption.

    Inputs: x [B, T, d_model], the new tokens' hidden states (already normalized); c_kv [B, S, kv_rank], the
    cached latents (already normalized); k_rope [B, S, rope], the cached shared rope keys (already rotated at
    their positions); cos, sin [T, rope/2], RoPE at the new tokens' positions, half layout (pairs (i, i + rope/2):
    out = (x1·cos − x2·sin, x1·sin + x2·cos) on the two halves). rope = k_rope.shape[-1].

    Naively, head h's logit for new token t and cached token s is
        ( q_nope[h,t] · (W_UK,h c_kv[s])  +  RoPE(q_rope[h,t]) · k_rope[s] ) / √(nope + rope),
    with [q_nope; q_rope] = wq_h x[t]. Building W_UK,h c_kv[s] for every cached token and head costs
    2·S·kv_rank·H·nope FLOPs per step — the cost the cache was meant to save. Absorb instead:
        q_nope · (W_UK,h c) = (W_UK,hᵀ q_nope) · c,
    so map each head's query into the latent space once (q_latent [B, H, T, kv_rank]) and score it against c_kv
    directly. The rope part stays as it is (k_rope is shared by all heads). No causal mask: every cached token is
    visible to the new ones.

    Hints: w_q = wq.view(H, nope + rope, d_model), w_uk = wkv_b.view(H, -1, kv_rank)[:, :nope]; torch.einsum
    writes each product in one line ("bti,hni->bhtn", then "bhtn,hnc->bhtc", then "bhtc,bsc->bhts"). The
    grader's FLOP budget, for 1 token against 512 cached, is half of what rebuilding the keys alone would cost.
    """
    raise NotImplementedError("exercise: absorb W_UK into the query and score the cached latents directly")


def max_cached_tokens(cfg: ModelConfig, memory_bytes: int, batch: int = 1, bytes_per_element: float = 2.0) -> int:
    """The largest T such that the KV cache of `batch` sequences of T tokens fits in `memory_bytes`.

    Numbers cached per token and layer (DeepSeek-V2, Table 1): 2·n_kv_heads·head_dim for MHA, GQA and MQA (a key
    and a value per kv head; n_kv_heads == n_heads is MHA, 1 is MQA), kv_lora_rank + qk_rope_head_dim for MLA
    (cfg.attention == "mla": the latent and the one shared rope key). Times n_layers, times batch, times
    bytes_per_element (2 for bf16, 1 for fp8, 0.75 for 6 bits) gives the bytes per token of context; the answer
    is how many whole tokens fit. For Llama-2-7B in bf16, 2 GiB hold exactly 4096 tokens (the notebook's number).

    Return an int. Careful with floats at the boundary: 0.75 bytes × a count should not round the answer one
    token too far or short (fractions.Fraction or integer arithmetic avoid it). The grader checks that your T
    fits and T + 1 does not, with `kv_cache_bytes`, on MHA, GQA, MQA and MLA shapes.
    """
    raise NotImplementedError("exercise: memory / (bytes per token of KV cache), rounded down")
