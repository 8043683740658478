"""Context extension (chapter 04): YaRN against its formulas computed independently in numpy, the attention
temperature as it reaches the logits, config wiring, bad input, and a YaRN model that trains."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minidist.model import build_model, get_preset, lm_loss
from minidist.model.attention import GroupedQueryAttention
from minidist.model.rope import (
    apply_rotary,
    linear_frequencies,
    ntk_frequencies,
    rope_cos_sin,
    rope_for_config,
    rope_frequencies,
    yarn_attention_scale,
    yarn_correction_range,
    yarn_frequencies,
)


def yarn_by_hand(d: int, base: float, s: float, L: int, beta_fast: float = 32.0, beta_slow: float = 1.0):
    """Peng et al. 2023 §3.2 with the reference code's ramp, written out from the formulas in numpy.

    Pair i has θ_i = base^(−2i/d), wavelength λ_i = 2π/θ_i, and turns r_i = L/λ_i times in the trained context.
    The pair index at which r = β is d·ln(L/(2πβ)) / (2 ln base). Pairs up to floor(index(β_fast)) keep θ_i, pairs
    from ceil(index(β_slow)) on get θ_i/s, linear in the index between. Attention: √(1/t) = 0.1 ln s + 1.
    """
    i = np.arange(d // 2, dtype=np.float64)
    theta = base ** (-2.0 * i / d)
    index_of = lambda beta: d * np.log(L / (2 * np.pi * beta)) / (2 * np.log(base))  # noqa: E731
    lo = max(np.floor(index_of(beta_fast)), 0.0)
    hi = min(np.ceil(index_of(beta_slow)), d - 1.0)
    if hi == lo:
        hi += 1e-3
    interp_weight = np.clip((i - lo) / (hi - lo), 0.0, 1.0)  # 1 − γ in the paper's notation
    return (1 - interp_weight) * theta + interp_weight * theta / s, 0.1 * np.log(s) + 1.0, (lo, hi)


CASES = [(128, 10000.0, 16.0, 4096), (64, 10000.0, 40.0, 4096), (32, 10000.0, 4.0, 32), (16, 500.0, 8.0, 256),
         (128, 500000.0, 8.0, 8192), (8, 10000.0, 2.0, 2048)]


@pytest.mark.parametrize("d,base,s,L", CASES)
def test_yarn_matches_formulas(d, base, s, L):
    inv_freq, scale = yarn_frequencies(d, base, s, L)
    want, want_scale, (lo, hi) = yarn_by_hand(d, base, s, L)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (d // 2,)
    np.testing.assert_allclose(inv_freq.double().numpy(), want, rtol=1e-6)
    assert scale == pytest.approx(want_scale, rel=1e-12)
    # The paper's regions: pairs that turn more than β_fast times in L are left alone, fewer than β_slow interpolated.
    theta = base ** (-2.0 * np.arange(d // 2) / d)
    turns = L * theta / (2 * np.pi)
    got = inv_freq.double().numpy()
    np.testing.assert_allclose(got[turns > 32 * 1.0001], theta[turns > 32 * 1.0001], rtol=1e-6)
    np.testing.assert_allclose(got[turns < 1 / 1.0001], theta[turns < 1 / 1.0001] / s, rtol=1e-6)
    assert np.all(got <= theta * (1 + 1e-6)) and np.all(got >= theta / s * (1 - 1e-6))


def test_correction_range_by_hand():
    # d=128, base 1e4, L=4096: index(32) = 128·ln(4096/(64π)) / (2 ln 1e4) = 128·3.0142/18.4207 = 20.94 → 20;
    # index(1) = 128·ln(4096/(2π)) / 18.4207 = 128·6.4798/18.4207 = 45.03 → 46.
    assert yarn_correction_range(128, 10000.0, 4096) == (20, 46)
    # DeepSeek-V2/V3 rope dims: d=64 → 10.47 → 10 and 22.51 → 23.
    assert yarn_correction_range(64, 10000.0, 4096) == (10, 23)
    # Training context 32 (chapter 04's experiment): index(32) < 0 → 0; index(1) = 32·ln(32/(2π))/18.42 = 2.83 → 3.
    assert yarn_correction_range(32, 10000.0, 32) == (0, 3)


def test_attention_scale_values():
    assert yarn_attention_scale(1.0) == 1.0
    assert yarn_attention_scale(40.0) == pytest.approx(1 + 0.1 * math.log(40))  # 1.3689 (DeepSeek-V3's factor)
    assert yarn_attention_scale(math.e ** 2) == pytest.approx(1.2)


def test_yarn_temperature_reaches_the_logits_as_one_over_t():
    """The model scales cos and sin by √(1/t); attention must then equal softmax(q·k/(t·√d)) with unscaled RoPE."""
    cfg = get_preset("tiny", d_model=64, n_heads=4, n_kv_heads=2,
                     rope_scaling=dict(kind="yarn", factor=8.0, original_max_seq_len=32))
    torch.manual_seed(0)
    attn = GroupedQueryAttention(cfg).double()
    inv_freq, scale = rope_for_config(cfg)
    assert scale == pytest.approx(0.1 * math.log(8.0) + 1)
    x = torch.randn(2, 40, 64, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(40), inv_freq, dtype=torch.float64)
    got = attn(x, (cos * scale, sin * scale))

    hd = cfg.head_dim
    q = apply_rotary(attn.wq(x).view(2, 40, 4, hd).transpose(1, 2), cos, sin)
    k = apply_rotary(attn.wk(x).view(2, 40, 2, hd).transpose(1, 2), cos, sin).repeat_interleave(2, dim=1)
    v = attn.wv(x).view(2, 40, 2, hd).transpose(1, 2).repeat_interleave(2, dim=1)
    inv_t = (0.1 * math.log(8.0) + 1) ** 2
    logits = q @ k.transpose(-1, -2) * inv_t / math.sqrt(hd)
    logits = logits.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    want = attn.wo((logits.softmax(-1) @ v).transpose(1, 2).reshape(2, 40, 64))
    torch.testing.assert_close(got, want)


def test_config_wiring_for_each_kind():
    base = get_preset("tiny")
    d = base.head_dim
    for kind, expected in [("none", (rope_frequencies(d), 1.0)), ("linear", (linear_frequencies(d, 1e4, 4.0), 1.0)),
                           ("ntk", (ntk_frequencies(d, 1e4, 4.0), 1.0)), ("yarn", yarn_frequencies(d, 1e4, 4.0, 64))]:
        cfg = base.replace(rope_scaling=dict(kind=kind, factor=4.0, original_max_seq_len=64))
        inv_freq, scale = rope_for_config(cfg)
        torch.testing.assert_close(inv_freq, expected[0])
        assert scale == expected[1]
        model = build_model(cfg)
        cos, sin = model.rotary(torch.arange(5))
        torch.testing.assert_close(cos ** 2 + sin ** 2, torch.full_like(cos, expected[1] ** 2))
    # MLA rotates only the rope dims, so the temperature goes into its softmax scale instead of cos/sin.
    mla = base.replace(attention="mla", rope_scaling=dict(kind="yarn", factor=4.0, original_max_seq_len=64))
    inv_freq, scale = rope_for_config(mla)
    assert scale == 1.0 and inv_freq.shape == (mla.mla.qk_rope_head_dim // 2,)


@pytest.mark.parametrize("bad", [dict(kind="yarn", factor=0.5, original_max_seq_len=32),
                                 dict(kind="linear", factor=0.99), dict(kind="yarn", factor=4.0),
                                 dict(kind="stretch", factor=2.0),
                                 dict(kind="yarn", factor=2.0, original_max_seq_len=32, beta_fast=1.0, beta_slow=2.0)])
def test_bad_scaling_config_one_line_error(bad):
    with pytest.raises(ValueError) as err:
        get_preset("tiny", rope_scaling=bad)
    assert "\n" not in str(err.value)


def test_bad_function_input_one_line_error():
    for call in (lambda: yarn_frequencies(32, 1e4, 0.5, 32), lambda: yarn_frequencies(31, 1e4, 2.0, 32),
                 lambda: yarn_frequencies(32, 1e4, 2.0, 0), lambda: yarn_attention_scale(0.1)):
        with pytest.raises(ValueError) as err:
            call()
        assert "\n" not in str(err.value)


def test_yarn_model_trains_and_runs_past_its_context(one_thread):
    torch.manual_seed(0)
    cfg = get_preset("tiny", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128,
                     rope_scaling=dict(kind="yarn", factor=4.0, original_max_seq_len=16))
    model = build_model(cfg, seed=0)
    # A learnable stream: a fixed random 24-token motif repeated, so the loss can fall far in a few steps.
    motif = torch.randint(0, 256, (24,))
    data = motif.repeat(12)
    starts = torch.randint(0, data.numel() - 49, (8,))
    batch = torch.stack([data[s:s + 49] for s in starts])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = lm_loss(model(batch[:, :48]), batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert math.isfinite(F.cross_entropy(model(batch[:, :48]).flatten(0, 1), batch[:, 1:].flatten()).item())
