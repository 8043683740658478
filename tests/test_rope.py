"""RoPE (chapter 03): the rotation against explicit 2x2 matrices, both layouts and the permutation between them,
the relative-position property, position interpolation and NTK-aware scaling against their formulas."""

import math

import numpy as np
import pytest
import torch

from minidist.model import build_model, get_preset
from minidist.model.rope import (
    apply_rope,
    apply_rotary,
    interleaved_to_half_permutation,
    linear_frequencies,
    ntk_base,
    ntk_frequencies,
    rope_cos_sin,
    rope_frequencies,
    rotate_half,
)


def numpy_rope(x: np.ndarray, positions: np.ndarray, base: float, pairs: list[tuple[int, int]]) -> np.ndarray:
    """RoFormer eq. 34 literally: pair (a, b) number i is multiplied by the 2x2 rotation matrix R(m·θ_i)."""
    d = x.shape[-1]
    out = np.empty_like(x)
    for t, m in enumerate(positions):
        for i, (a, b) in enumerate(pairs):
            angle = m * base ** (-2 * i / d)
            rot = np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
            out[..., t, [a, b]] = x[..., t, [a, b]] @ rot.T
    return out


def interleaved_pairs(d):
    return [(2 * i, 2 * i + 1) for i in range(d // 2)]


def half_pairs(d):
    return [(i, i + d // 2) for i in range(d // 2)]


@pytest.mark.parametrize("head_dim,base", [(8, 10000.0), (16, 500.0), (64, 1e6)])
def test_frequencies_match_formula(head_dim, base):
    expected = np.array([base ** (-2 * i / head_dim) for i in range(head_dim // 2)])
    np.testing.assert_allclose(rope_frequencies(head_dim, base).numpy(), expected, rtol=1e-6)


@pytest.mark.parametrize("layout,pairs", [("interleaved", interleaved_pairs), ("half", half_pairs)])
def test_both_layouts_match_explicit_rotation_matrices(layout, pairs):
    d, base = 12, 100.0
    x = torch.randn(2, 3, 7, d, dtype=torch.float64)
    positions = torch.tensor([0, 1, 2, 5, 17, 100, 1234])
    got = apply_rope(x, positions, rope_frequencies(d, base).double(), layout=layout)
    want = numpy_rope(x.numpy(), positions.numpy(), base, pairs(d))
    # The frequencies are stored in float32; at position 1234 that is an angle error of ~1e-4.
    np.testing.assert_allclose(got.numpy(), want, atol=2e-4)
    np.testing.assert_allclose(got[..., :5, :].numpy(), want[..., :5, :], atol=1e-6)


def test_rotate_half_form_equals_pairwise_form():
    d = 16
    x = torch.randn(4, 9, d, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(9), rope_frequencies(d), dtype=torch.float64)
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    torch.testing.assert_close(x * full_cos + rotate_half(x) * full_sin, apply_rotary(x, cos, sin, "half"))


def test_permutation_maps_interleaved_onto_half():
    d = 16
    perm = interleaved_to_half_permutation(d)
    assert sorted(perm.tolist()) == list(range(d))
    assert perm.tolist()[:3] == [0, 2, 4] and perm.tolist()[d // 2: d // 2 + 2] == [1, 3]
    x = torch.randn(3, 11, d, dtype=torch.float64)
    pos, freqs = torch.arange(11), rope_frequencies(d).double()
    torch.testing.assert_close(apply_rope(x[..., perm], pos, freqs, "half"),
                               apply_rope(x, pos, freqs, "interleaved")[..., perm])
    # ... so attention scores, q·k with both permuted alike, are identical in either layout.
    q, k = torch.randn(11, d, dtype=torch.float64), torch.randn(11, d, dtype=torch.float64)
    s_inter = apply_rope(q, pos, freqs, "interleaved") @ apply_rope(k, pos, freqs, "interleaved").T
    s_half = apply_rope(q[:, perm], pos, freqs, "half") @ apply_rope(k[:, perm], pos, freqs, "half").T
    torch.testing.assert_close(s_inter, s_half)


def test_model_checkpoint_converts_between_layouts_by_permuting_wq_wk_rows():
    cfg = get_preset("tiny", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, rope_layout="interleaved")
    inter = build_model(cfg, seed=3)
    half = build_model(cfg.replace(rope_layout="half"), seed=3)
    perm = interleaved_to_half_permutation(cfg.head_dim)
    state = inter.state_dict()
    for name, w in list(state.items()):
        if name.endswith(("attn.wq.weight", "attn.wk.weight")):
            heads = w.shape[0] // cfg.head_dim
            state[name] = w.view(heads, cfg.head_dim, -1)[:, perm].reshape(w.shape)
    half.load_state_dict(state)
    tokens = torch.randint(0, 256, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(half(tokens), inter(tokens), atol=1e-5, rtol=1e-4)
        assert (half(tokens) - build_model(cfg.replace(rope_layout="half"), seed=3)(tokens)).abs().max() > 1e-3


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_relative_position_property(layout):
    """q_m · k_n depends only on m − n: shifting both positions by c changes nothing (and rotation keeps norms)."""
    d = 32
    freqs = rope_frequencies(d).double()
    q, k = torch.randn(d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)

    def score(m, n):
        qm = apply_rope(q[None], torch.tensor([m]), freqs, layout)[0]
        kn = apply_rope(k[None], torch.tensor([n]), freqs, layout)[0]
        return float(qm @ kn)

    for m, n in [(5, 2), (0, 0), (40, 7), (3, 30)]:
        for shift in (1, 13, 1000):
            assert score(m + shift, n + shift) == pytest.approx(score(m, n), abs=1e-9)
    assert abs(score(5, 2) - score(5, 3)) > 1e-6  # it does depend on m − n
    rotated = apply_rope(q[None].expand(50, d), torch.arange(50), freqs, layout)
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm().expand(50))


def test_position_interpolation_equals_fractional_positions():
    d, s = 16, 4.0
    x = torch.randn(2, 20, d, dtype=torch.float64)
    pos = torch.arange(20)
    torch.testing.assert_close(apply_rope(x, pos, linear_frequencies(d, 10000.0, s)),
                               apply_rope(x, pos.double() / s, rope_frequencies(d, 10000.0)))


@pytest.mark.parametrize("d,base,s", [(8, 10000.0, 2.0), (64, 10000.0, 8.0), (128, 500000.0, 4.0)])
def test_ntk_base_formula(d, base, s):
    assert ntk_base(d, base, s) == pytest.approx(base * s ** (d / (d - 2)), rel=1e-12)
    theta, ntk = rope_frequencies(d, base).double(), ntk_frequencies(d, base, s).double()
    assert float(ntk[0]) == pytest.approx(float(theta[0]))  # the fastest pair is not touched ...
    assert float(ntk[-1]) == pytest.approx(float(theta[-1]) / s, rel=1e-5)  # ... the slowest one by s
    assert torch.all(ntk[1:] < theta[1:]) and torch.all(ntk[1:-1] > theta[1:-1] / s)  # in between


def test_bad_input_one_line_errors():
    for call in (lambda: rope_frequencies(7), lambda: linear_frequencies(9, 1e4, 2.0),
                 lambda: interleaved_to_half_permutation(5),
                 lambda: apply_rotary(torch.zeros(2, 4), torch.zeros(2, 2), torch.zeros(2, 2), "spiral"),
                 lambda: get_preset("tiny", d_model=60, n_heads=4),  # head_dim 15
                 lambda: linear_frequencies(8, 1e4, 0.5), lambda: ntk_frequencies(8, 1e4, 0.9)):
        with pytest.raises(ValueError) as err:
            call()
        assert "\n" not in str(err.value)
