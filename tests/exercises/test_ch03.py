"""Grade chapter 03's exercises: partial RoPE in the interleaved layout, and converting a half-layout checkpoint.

`pytest tests/exercises -k ch03` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
The oracles: `minidist.model.rope.apply_rope` on the rotated slice, the relative-position property (shifting every
position leaves every score unchanged), and two models of minidist — one per layout — that must agree once the
weights are converted.
"""

import pytest
import torch
from grading import load

from minidist.model import build_model, get_preset
from minidist.model import rope as md_rope

MODULE = "ch03_rope"
pytestmark = pytest.mark.usefixtures("one_thread")

B, H, T, D = 2, 3, 12, 16
# Sequence 0 at positions 0..11; sequence 1 further on, with gaps and fractional positions (as position
# interpolation makes them, chapter 04).
POSITIONS = torch.stack((torch.arange(T, dtype=torch.float64), 100 + 2.5 * torch.arange(T, dtype=torch.float64)))


def _x(seed: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _reference(x: torch.Tensor, rotary_dim: int, base: float) -> torch.Tensor:
    """minidist's interleaved RoPE on the first rotary_dim dimensions, one sequence at a time; the rest unchanged."""
    theta = md_rope.rope_frequencies(rotary_dim, base).double()
    rows = [md_rope.apply_rope(x[b, ..., :rotary_dim], POSITIONS[b], theta, layout="interleaved") for b in range(B)]
    return torch.cat((torch.stack(rows), x[..., rotary_dim:]), dim=-1)


@pytest.mark.parametrize("rotary_dim", [4, 8, 16])
def test_ch03_partial_rope_values(impl: str, rotary_dim: int) -> None:
    apply_partial_rope = load(impl, MODULE, "apply_partial_rope")
    x = _x(0)
    before = x.clone()
    got = apply_partial_rope(x, POSITIONS, rotary_dim, 500.0)
    where = f"apply_partial_rope(rotary_dim={rotary_dim} of head_dim {D}, base 500)"
    assert torch.equal(x, before), f"{where} changed its input in place"
    assert got.shape == x.shape and got.dtype == x.dtype, f"{where}: {tuple(got.shape)} {got.dtype}, expected " \
                                                          f"{tuple(x.shape)} {x.dtype}"
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:]), \
        f"{where}: dimensions {rotary_dim}..{D - 1} must pass through unchanged — rotate only the first rotary_dim"
    expected = _reference(x, rotary_dim, 500.0)
    if not torch.allclose(got, expected, rtol=0, atol=1e-4):
        hint = ""
        half = [md_rope.apply_rope(x[b, ..., :rotary_dim], POSITIONS[b], md_rope.rope_frequencies(rotary_dim, 500.0)
                                   .double(), layout="half") for b in range(B)]
        if torch.allclose(got[..., :rotary_dim], torch.stack(half), atol=1e-4):
            hint = " — that is the half layout; pair i is (2i, 2i + 1) here"
        elif rotary_dim < D and torch.allclose(got[..., :rotary_dim], _reference(x, D, 500.0)[..., :rotary_dim],
                                               atol=1e-4):
            hint = " — θ_i = base^(-2i / rotary_dim): the exponent uses the rotated width, not head_dim"
        elif torch.allclose(got[0], expected[0], atol=1e-4):
            hint = " — sequence 0 is right, sequence 1 is not: each row of `positions` belongs to its own sequence"
        worst = (got - expected).abs().max().item()
        pytest.fail(f"{where}: differs from minidist's interleaved RoPE by up to {worst:.2e}{hint}", pytrace=False)


def test_ch03_partial_rope_is_relative(impl: str) -> None:
    apply_partial_rope = load(impl, MODULE, "apply_partial_rope")
    q, k = _x(1), _x(2)

    def scores(shift: float) -> torch.Tensor:
        positions = POSITIONS + shift
        return apply_partial_rope(q, positions, 8, 10000.0) @ apply_partial_rope(k, positions, 8, 10000.0).transpose(
            -1, -2)

    gap = (scores(0.0) - scores(1000.5)).abs().max().item()
    assert gap < 1e-8, (f"apply_partial_rope: shifting every position by 1000.5 changed a score q·k by {gap:.2e}; "
                        "a rotation by angles m·θ_i must leave q_m·k_n depending on m − n only (fractional positions "
                        "included: compute the angles in floating point)")
    norms = apply_partial_rope(q, POSITIONS, 8, 10000.0).norm(dim=-1)
    kept = torch.allclose(norms, q.norm(dim=-1), rtol=1e-12)
    assert kept, "apply_partial_rope: a rotation must keep the norm of every vector"


def test_ch03_partial_rope_keeps_float32(impl: str) -> None:
    apply_partial_rope = load(impl, MODULE, "apply_partial_rope")
    x = _x(3, torch.float32)
    got = apply_partial_rope(x, POSITIONS, 8, 10000.0)
    assert got.dtype == torch.float32, f"apply_partial_rope(float32 x) returned {got.dtype}"
    close = torch.allclose(got.double(), _reference(x.double(), 8, 10000.0), atol=1e-4)
    assert close, "apply_partial_rope(float32 x): values differ from minidist's interleaved RoPE"


def test_ch03_half_to_interleaved_rows_converts_a_model(impl: str) -> None:
    half_to_interleaved_rows = load(impl, MODULE, "half_to_interleaved_rows")
    cfg = get_preset("tiny", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, rope_layout="half")
    hf_style, meta_style = build_model(cfg, seed=3), build_model(cfg.replace(rope_layout="interleaved"), seed=4)
    state = hf_style.state_dict()
    perm = md_rope.interleaved_to_half_permutation(cfg.head_dim)
    for name, w in list(state.items()):
        if name.endswith(("attn.wq.weight", "attn.wk.weight")):
            converted = half_to_interleaved_rows(w, cfg.head_dim)
            assert converted.shape == w.shape, f"half_to_interleaved_rows({name}): shape {tuple(converted.shape)}"
            heads = converted.view(-1, cfg.head_dim, w.shape[1])
            if not torch.equal(heads[:, perm].reshape(w.shape), w):
                hint = " — reorder the rows inside each head (view as [heads, head_dim, d_in]), not the whole matrix"
                if torch.equal(converted, w.view(-1, cfg.head_dim, w.shape[1])[:, perm].reshape(w.shape)):
                    hint = " — that applies interleaved_to_half's P again; the other direction is its inverse"
                pytest.fail(f"half_to_interleaved_rows({name}, head_dim={cfg.head_dim}): interleaved_to_half "
                            f"applied to the result does not give back the half-layout weight{hint}", pytrace=False)
            state[name] = converted
    meta_style.load_state_dict(state)
    tokens = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        gap = (meta_style(tokens) - hf_style(tokens)).abs().max().item()
    assert gap < 1e-4, f"half_to_interleaved_rows: the converted interleaved model's logits differ by {gap:.2e}"
