"""Grade chapter 05's exercises: MLA decoding scores against the latent cache, and the longest context that fits.

`pytest tests/exercises -k ch05` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
The absorbed scores must equal the naive ones (per-head keys rebuilt from the latents, DeepSeek-V2 eqs. 9-18), and
must cost far fewer FLOPs than rebuilding those keys (FlopCounterMode). The context length is checked against
`minidist.model.kv_cache.kv_cache_bytes`: the cache of that many tokens fits, one more does not.
"""

import math

import pytest
import torch
from grading import load
from torch.utils.flop_counter import FlopCounterMode

from minidist.model import get_preset
from minidist.model import rope as md_rope
from minidist.model.kv_cache import kv_cache_bytes
from minidist.model.mla import mla_reference_config

MODULE = "ch05_attention"
pytestmark = pytest.mark.usefixtures("one_thread")

D, HEADS, NOPE, ROPE, D_C, V = 64, 8, 32, 8, 16, 16


def _case(batch: int, new: int, cached: int, seed: int = 0) -> dict:
    """Weights, new tokens x at the last `new` positions, and a cache of `cached` tokens (latents, rotated keys)."""
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    positions = torch.arange(cached - new, cached, dtype=torch.float64)
    cos, sin = md_rope.rope_cos_sin(positions, md_rope.rope_frequencies(ROPE), dtype=torch.float64)
    cache_cos, cache_sin = md_rope.rope_cos_sin(torch.arange(cached), md_rope.rope_frequencies(ROPE),
                                                dtype=torch.float64)
    return dict(x=randn(batch, new, D), c_kv=randn(batch, cached, D_C),
                k_rope=md_rope.apply_rotary(randn(batch, cached, ROPE), cache_cos, cache_sin),
                wq=randn(HEADS * (NOPE + ROPE), D) / math.sqrt(D),
                wkv_b=randn(HEADS * (NOPE + V), D_C) / math.sqrt(D_C),
                n_heads=HEADS, qk_nope_head_dim=NOPE, cos=cos, sin=sin)


def _naive_parts(c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(content, rope) parts of q·k, unscaled, with per-head keys rebuilt from the latents (no absorption)."""
    batch, new, _ = c["x"].shape
    q = (c["x"] @ c["wq"].T).view(batch, new, HEADS, NOPE + ROPE).transpose(1, 2)
    q_nope, q_rope = q.split([NOPE, ROPE], dim=-1)
    q_rope = md_rope.apply_rotary(q_rope, c["cos"], c["sin"], layout="half")
    kv = (c["c_kv"] @ c["wkv_b"].T).view(batch, -1, HEADS, NOPE + V).transpose(1, 2)
    k_nope = kv[..., :NOPE]  # [B, H, S, nope]: what absorption avoids building
    return q_nope @ k_nope.transpose(-1, -2), q_rope @ c["k_rope"][:, None].transpose(-1, -2)


def test_ch05_mla_decode_scores_equal_the_naive_scores(impl: str) -> None:
    mla_decode_scores = load(impl, MODULE, "mla_decode_scores")
    c = _case(batch=2, new=3, cached=20)
    content, rope = _naive_parts(c)
    expected = (content + rope) / math.sqrt(NOPE + ROPE)
    got = mla_decode_scores(**c)
    where = f"mla_decode_scores(B=2, 3 new tokens, 20 cached, {HEADS} heads, nope {NOPE}, rope {ROPE}, d_c {D_C})"
    assert got.shape == expected.shape, f"{where}: shape {tuple(got.shape)}, expected {tuple(expected.shape)} " \
                                        "[batch, heads, new tokens, cached tokens]"
    if not torch.allclose(got, expected, rtol=0, atol=1e-10):
        unrotated = content + (_naive_parts({**c, "cos": torch.ones_like(c["cos"]), "sin": 0 * c["sin"]})[1])
        variants = {
            "unscaled: divide the logits by √(nope + rope)": content + rope,
            "scaled by 1/√nope: the logit spans nope + rope dimensions": (content + rope) / math.sqrt(NOPE),
            "missing the rope part q_rope·k_rope (the decoupled RoPE key is shared by all heads)":
                content / math.sqrt(NOPE + ROPE),
            "the query's rope part is not rotated: rotate it with cos/sin (half layout)":
                unrotated / math.sqrt(NOPE + ROPE),
        }
        hint = next((f" — {why}" for why, v in variants.items() if torch.allclose(got, v, rtol=0, atol=1e-10)), "")
        worst = (got - expected).abs().max().item()
        pytest.fail(f"{where}: differs from the naive scores by up to {worst:.2e}{hint}", pytrace=False)


def test_ch05_mla_decode_scores_do_not_rebuild_keys(impl: str) -> None:
    """One new token against 512 cached ones: rebuilding the per-head keys alone would cost 2·S·d_c·H·nope FLOPs."""
    mla_decode_scores = load(impl, MODULE, "mla_decode_scores")
    c = _case(batch=1, new=1, cached=512, seed=1)
    counter = FlopCounterMode(display=False)
    with counter:
        got = mla_decode_scores(**c)
    content, rope = _naive_parts(c)
    close = torch.allclose(got, (content + rope) / math.sqrt(NOPE + ROPE), rtol=0, atol=1e-10)
    assert close, "mla_decode_scores: wrong values for one new token against 512 cached ones"
    rebuild = 2 * 512 * D_C * HEADS * NOPE
    flops = counter.get_total_flops()
    assert flops <= rebuild / 2, (
        f"mla_decode_scores: {flops:,} FLOPs for one token against 512 cached; rebuilding the keys alone costs "
        f"{rebuild:,}. Absorb W_UK into the query (q_latent = W_UKᵀ q_nope per head) and score the latents directly")


# (name, config, memory in bytes, batch, bytes per element)
GIB = 2**30
CONTEXT_CASES = {
    "Llama-2-7B (MHA), 2 GiB": (get_preset("llama2-7b"), 2 * GIB, 1, 2.0),
    "Llama-3-8B (GQA), 80 GiB, batch 8": (get_preset("llama3-8b"), 80 * GIB, 8, 2.0),
    "Llama-2-70B as MQA, 1234567891 bytes, fp8": (get_preset("llama2-70b", n_kv_heads=1), 1_234_567_891, 1, 1.0),
    "DeepSeek-V2 (MLA), 40 GiB, batch 4": (mla_reference_config("deepseek-v2"), 40 * GIB, 4, 2.0),
    "DeepSeek-V2 (MLA), 6-bit cache, 1 GiB": (mla_reference_config("deepseek-v2"), GIB, 1, 0.75),
}


def _context_hint(cfg, got: int, expected: int) -> str:
    if got <= 0 or expected <= 0:
        return ""
    ratio = expected / got
    factors = {"n_layers: every layer caches its own keys and values": cfg.n_layers,
               "2: a key and a value per kv head": 2}
    if cfg.attention == "mla":
        mha = 2 * cfg.n_heads * cfg.mla.qk_nope_head_dim / (cfg.mla.kv_lora_rank + cfg.mla.qk_rope_head_dim)
        factors["MLA's cache: kv_lora_rank + qk_rope_head_dim numbers per token and layer, not per-head keys"] = mha
    else:
        factors["n_kv_heads, not n_heads: query heads share their group's key and value"] = (
            cfg.n_heads / cfg.n_kv_heads)
    for why, factor in factors.items():
        if factor != 1 and (math.isclose(ratio, 1 / factor, rel_tol=1e-3) or math.isclose(ratio, factor, rel_tol=1e-3)):
            return f" — off by a factor {factor:g}: {why}"
    return ""


@pytest.mark.parametrize("case", CONTEXT_CASES)
def test_ch05_max_cached_tokens(impl: str, case: str) -> None:
    max_cached_tokens = load(impl, MODULE, "max_cached_tokens")
    cfg, memory, batch, bytes_per_element = CONTEXT_CASES[case]
    got = max_cached_tokens(cfg, memory, batch, bytes_per_element)
    assert isinstance(got, int), f"max_cached_tokens({case}): returned {type(got).__name__}, expected int (tokens)"
    fits = kv_cache_bytes(cfg, tokens=got, batch=batch, bytes_per_element=bytes_per_element) <= memory
    one_more = kv_cache_bytes(cfg, tokens=got + 1, batch=batch, bytes_per_element=bytes_per_element) <= memory
    if not fits or one_more:
        per_token = kv_cache_bytes(cfg, tokens=1, batch=batch, bytes_per_element=bytes_per_element)
        expected = int(memory // per_token)
        what = "does not fit" if not fits else "fits, and so does one more token"
        pytest.fail(f"max_cached_tokens({case}): {got:,} tokens {what}; the answer is {expected:,} "
                    f"({per_token:,.0f} bytes per token of context){_context_hint(cfg, got, expected)}",
                    pytrace=False)
