"""Grade chapter 04's exercises: Llama 3.1's by-parts frequencies, dynamic NTK scaling, and YaRN's temperature
under MLA.

`pytest tests/exercises -k ch04` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
Llama 3.1's rule is stated in wavelengths; the grader checks it against the same rule written as YaRN's eq. 18-19
ramp in the number of turns r = L/λ, and against its limits (fast pairs kept, slow pairs divided by s). Dynamic
NTK and the MLA softmax scale are checked against `minidist.model.rope` and `minidist.model.mla`.
"""

import math

import pytest
import torch
from grading import load

from minidist.model import get_preset
from minidist.model import rope as md_rope
from minidist.model.mla import mla_softmax_scale

MODULE = "ch04_context"

# (head_dim, base, factor, original context, low_freq_factor, high_freq_factor)
LLAMA3_CASES = {
    "Llama 3.1 (d 128, base 500000, s 8, L 8192)": (128, 500000.0, 8.0, 8192, 1.0, 4.0),
    "d 64, base 10000, s 4, L 2048": (64, 10000.0, 4.0, 2048, 1.0, 4.0),
    "d 32, base 10000, s 16, L 256, factors 2 and 8": (32, 10000.0, 16.0, 256, 2.0, 8.0),
}


def _theta(head_dim: int, base: float) -> torch.Tensor:
    return base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def _by_turns(head_dim, base, factor, context, alpha, beta) -> torch.Tensor:
    """YaRN eq. 18-19: γ = clamp((r − α)/(β − α), 0, 1) with r = L/λ turns; θ' = (1 − γ)·θ/s + γ·θ."""
    theta = _theta(head_dim, base)
    turns = context * theta / (2 * math.pi)
    gamma = ((turns - alpha) / (beta - alpha)).clamp(0.0, 1.0)
    return (1 - gamma) * theta / factor + gamma * theta


@pytest.mark.parametrize("case", LLAMA3_CASES)
def test_ch04_llama3_frequencies(impl: str, case: str) -> None:
    llama3_frequencies = load(impl, MODULE, "llama3_frequencies")
    d, base, s, context, low, high = LLAMA3_CASES[case]
    got = llama3_frequencies(d, base, s, context, low, high).double()
    expected = _by_turns(d, base, s, context, low, high)
    assert got.shape == (d // 2,), f"llama3_frequencies({case}): shape {tuple(got.shape)}, expected ({d // 2},)"
    theta = _theta(d, base)
    wavelength = 2 * math.pi / theta
    regions = torch.where(wavelength < context / high, 0, torch.where(wavelength > context / low, 2, 1))
    names = ["kept (wavelength below L/high_freq_factor: θ unchanged)",
             "blended ((1 − w)·θ/s + w·θ with w = (L/λ − low_freq_factor)/(high_freq_factor − low_freq_factor))",
             "interpolated (wavelength above L/low_freq_factor: θ/s)"]
    wrong = ~torch.isclose(got, expected, rtol=1e-6, atol=0)
    if wrong.any():
        i = int(wrong.nonzero()[0])
        pytest.fail(f"llama3_frequencies({case}): pair {i} (wavelength {wavelength[i]:.1f}) is {got[i]:.6g}, "
                    f"expected {expected[i]:.6g}; this pair should be {names[int(regions[i])]}", pytrace=False)


def test_ch04_llama3_frequencies_limits(impl: str) -> None:
    llama3_frequencies = load(impl, MODULE, "llama3_frequencies")
    d, base, s, context, low, high = LLAMA3_CASES["Llama 3.1 (d 128, base 500000, s 8, L 8192)"]
    theta = _theta(d, base)
    same = llama3_frequencies(d, base, 1.0, context, low, high).double()
    assert torch.allclose(same, theta, rtol=1e-6), "llama3_frequencies with factor 1 must be plain RoPE"
    ratio = llama3_frequencies(d, base, s, context, low, high).double() / theta
    assert abs(ratio[0] - 1) < 1e-6 and abs(ratio[-1] - 1 / s) < 1e-6, (
        f"llama3_frequencies(Llama 3.1): θ'/θ is {ratio[0]:.4f} for the fastest pair and {ratio[-1]:.4f} for the "
        f"slowest; expected 1 (kept) and 1/s = {1 / s:.4f} (interpolated)")
    assert bool((ratio[1:] <= ratio[:-1] + 1e-9).all()), \
        "llama3_frequencies: θ'/θ must never grow with the pair index (slower pairs are interpolated at least as much)"


@pytest.mark.parametrize("seq_len", [100, 2048, 2049, 8192, 20000])
def test_ch04_dynamic_ntk_frequencies(impl: str, seq_len: int) -> None:
    dynamic_ntk_frequencies = load(impl, MODULE, "dynamic_ntk_frequencies")
    d, base, context = 64, 10000.0, 2048
    got = dynamic_ntk_frequencies(d, base, context, seq_len).double()
    where = f"dynamic_ntk_frequencies(head_dim {d}, base {base:g}, trained at {context}, seq_len {seq_len})"
    if seq_len <= context:
        expected, rule = md_rope.rope_frequencies(d, base).double(), "plain RoPE while the sequence fits in L"
    else:
        expected = md_rope.ntk_frequencies(d, base, seq_len / context).double()
        rule = "NTK-aware scaling, base·s^(d/(d−2)) with s = T/L"
    close = torch.allclose(got, expected, rtol=1e-5)
    assert close, f"{where}: differs from {rule} by up to {(got / expected - 1).abs().max():.2e} (relative)"
    # The point of it: the slowest pair, at the last position, stays within the arc it turned during training.
    last_angle, trained = (seq_len - 1) * got[-1], context * _theta(d, base)[-1]
    assert last_angle <= trained * (1 + 1e-6), (f"{where}: the slowest pair reaches {last_angle:.4f} rad at the last "
                                               f"position, beyond the {trained:.4f} rad of the trained context")


MLA_CASES = [(128, 64, 40.0), (16, 8, 8.0), (32, 16, 1.0), (24, 8, 1000.0)]


@pytest.mark.parametrize("nope, rope, factor", MLA_CASES, ids=[f"nope{n}-rope{r}-s{s:g}" for n, r, s in MLA_CASES])
def test_ch04_mla_yarn_softmax_scale(impl: str, nope: int, rope: int, factor: float) -> None:
    mla_yarn_softmax_scale = load(impl, MODULE, "mla_yarn_softmax_scale")
    cfg = get_preset("tiny", attention="mla", mla=dict(kv_lora_rank=32, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                                                       v_head_dim=16),
                     rope_scaling=dict(kind="yarn", factor=factor, original_max_seq_len=64))
    expected = mla_softmax_scale(cfg)
    got = mla_yarn_softmax_scale(nope, rope, factor)
    mscale = 0.1 * math.log(factor) + 1
    hint = ""
    if math.isclose(got, mscale / math.sqrt(nope + rope), rel_tol=1e-9) and factor != 1:
        hint = " — √(1/t) = 0.1·ln s + 1 scales q and k; a logit q·k gets it twice"
    elif math.isclose(got, mscale**2 / math.sqrt(rope), rel_tol=1e-9):
        hint = " — the logit sums over nope + rope dimensions: divide by √(nope + rope)"
    assert math.isclose(got, expected, rel_tol=1e-9), (
        f"mla_yarn_softmax_scale(nope={nope}, rope={rope}, s={factor:g}): got {got:.6g}, expected {expected:.6g}{hint}")
