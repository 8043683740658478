"""Grade chapter 02's exercises: initialization for layers of unequal width, and the gain of any activation.

`pytest tests/exercises -k ch02` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
Each answer is checked twice: against `minidist.model.init` or Gauss–Hermite quadrature (a method the exercise does not
ask for), and by what initialization is for — a deep stack whose signal keeps its size, measured.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from grading import load

from minidist.model.init import kaiming_std, xavier_std

MODULE = "ch02_init"
pytestmark = pytest.mark.usefixtures("one_thread")

ACTIVATIONS = {"linear": lambda y: y, "relu": torch.relu, "tanh": torch.tanh, "gelu": F.gelu, "silu": F.silu}
WIDTHS = [16, 32, 64, 128, 256, 512]  # every layer doubles: fan_out = 2·fan_in, so fan-in and fan-out rules differ


def _reference_std(scheme: str, fan_in: int, fan_out: int) -> float:
    return {"lecun": kaiming_std(fan_in, gain=1.0), "xavier": xavier_std(fan_in, fan_out),
            "kaiming": kaiming_std(fan_in), "kaiming_fan_out": kaiming_std(fan_out)}[scheme]


@pytest.mark.parametrize("scheme", ["lecun", "xavier", "kaiming", "kaiming_fan_out"])
def test_ch02_layer_stds_formulas(impl: str, scheme: str) -> None:
    layer_stds = load(impl, MODULE, "layer_stds")
    widths = [64, 256, 32, 128]
    got = layer_stds(widths, scheme)
    assert len(got) == len(widths) - 1, f"layer_stds({widths}, {scheme!r}): {len(got)} stds for 3 layers"
    for i, (fan_in, fan_out) in enumerate(zip(widths[:-1], widths[1:])):
        expected = _reference_std(scheme, fan_in, fan_out)
        hint = ""
        if math.isclose(got[i], _reference_std(scheme, fan_out, fan_in), rel_tol=1e-9):
            hint = " — fan_in and fan_out swapped? Layer i maps widths[i] inputs to widths[i+1] outputs"
        elif math.isclose(got[i], expected**2, rel_tol=1e-9):
            hint = " — that is the variance; return its square root"
        assert math.isclose(got[i], expected, rel_tol=1e-9), (
            f"layer_stds({widths}, {scheme!r}), layer {i} ({fan_in} -> {fan_out}): got {got[i]:.5f}, "
            f"expected {expected:.5f}{hint}")


def _second_moments(stds: list[float], activation) -> tuple[list[float], list[float]]:
    """E[y²] of every layer's pre-activation (forward) and of the gradient at every layer's input (backward), for
    the stack y_l = φ(y_{l-1}) W_l over WIDTHS with the last layer linear, x ~ N(0, 1), a unit random output
    gradient."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n_in, n_out, generator=g) * std for n_in, n_out, std in zip(WIDTHS, WIDTHS[1:], stds)]
    h = torch.randn(2048, WIDTHS[0], generator=g)
    inputs, forward = [], []
    for i, w in enumerate(weights):
        h = h.detach().requires_grad_() if i == 0 else h
        h.retain_grad()
        inputs.append(h)
        y = h @ w
        forward.append(y.pow(2).mean().item())
        h = activation(y) if i < len(weights) - 1 else y
    (h * torch.randn(h.shape, generator=g)).sum().backward()
    return forward, [t.grad.pow(2).mean().item() for t in inputs]


# (scheme, activation, direction, per-layer factor of the second moment the derivation predicts for doubling widths)
MEASURED = [
    ("lecun", "linear", "forward", 1.0),
    ("kaiming", "relu", "forward", 1.0),
    ("kaiming_fan_out", "relu", "backward", 1.0),
    ("xavier", "linear", "forward", 2 / 3),  # n_in·2/(n_in + n_out) with n_out = 2·n_in
    ("xavier", "linear", "backward", 4 / 3),  # n_out·2/(n_in + n_out)
]


@pytest.mark.parametrize("scheme, activation, direction, factor", MEASURED,
                         ids=[f"{s}-{a}-{d}" for s, a, d, _ in MEASURED])
def test_ch02_layer_stds_measured(impl: str, scheme: str, activation: str, direction: str, factor: float) -> None:
    layer_stds = load(impl, MODULE, "layer_stds")
    forward, backward = _second_moments(layer_stds(WIDTHS, scheme), ACTIVATIONS[activation])
    # Geometric mean of the per-layer factor, skipping the first layer (its input is not an activation output)
    # and, backwards, the last one (its output has no activation).
    if direction == "forward":
        measured = (forward[-1] / forward[0]) ** (1 / (len(forward) - 1))
    else:
        measured = (backward[0] / backward[-1]) ** (1 / (len(backward) - 1))
    assert math.isclose(measured, factor, rel_tol=0.15), (
        f"layer_stds({WIDTHS}, {scheme!r}) in a {activation} stack: the {direction} second moment changes by "
        f"{measured:.3f}x per layer, the derivation predicts {factor:.3f}x — which fan does {scheme!r} divide by, "
        f"and does ReLU's halving of E[y²] appear in its variance?")


def _gauss_hermite_second_moment(activation: str) -> float:
    """E[φ(z)²], z ~ N(0, 1), by 200-point Gauss–Hermite quadrature (exact for polynomials up to degree 399)."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(200)
    values = ACTIVATIONS[activation](torch.tensor(nodes)).numpy()
    return float((weights * values**2).sum() / weights.sum())


@pytest.mark.parametrize("activation", ["linear", "relu", "tanh", "gelu", "silu"])
def test_ch02_activation_gain_value(impl: str, activation: str) -> None:
    activation_gain = load(impl, MODULE, "activation_gain")
    got = activation_gain(activation)
    if activation in ("linear", "relu"):
        expected, tol = (1.0 if activation == "linear" else math.sqrt(2)), 1e-6  # E[z²] = 1, E[relu(z)²] = 1/2
    else:
        expected, tol = 1 / math.sqrt(_gauss_hermite_second_moment(activation)), 1e-4
    z = torch.linspace(-12, 12, 100_001, dtype=torch.float64)
    pdf = torch.exp(-z**2 / 2) / math.sqrt(2 * math.pi)
    values = ACTIVATIONS[activation](z)
    mean = torch.trapezoid(values * pdf, z).item()
    hint = ""
    if math.isclose(got, expected**2, rel_tol=1e-3):
        hint = " — that is 1/E[φ(z)²]; the gain multiplies a standard deviation, so take the square root"
    elif math.isclose(got, 1 / expected, rel_tol=1e-3):
        hint = " — that is √E[φ(z)²]; the gain is its inverse"
    elif abs(mean) > 1e-3 and math.isclose(got, expected / math.sqrt(1 - mean**2 * expected**2), rel_tol=1e-3):
        hint = " — that uses Var(φ(z)); the next layer sums φ(z)·w, whose variance needs E[φ(z)²]"
    assert math.isclose(got, expected, rel_tol=tol), (
        f"activation_gain({activation!r}): got {got:.6f}, expected {expected:.6f}{hint}")


@pytest.mark.parametrize("activation", ["relu", "tanh", "gelu", "silu"])
def test_ch02_activation_gain_keeps_unit_variance(impl: str, activation: str) -> None:
    """8 layers of width 512 with std = gain/√fan_in: the pre-activations must keep E[y²] near 1."""
    gain = load(impl, MODULE, "activation_gain")(activation)
    phi, width = ACTIVATIONS[activation], 512
    g = torch.Generator().manual_seed(1)
    y = torch.randn(1024, width, generator=g)  # unit-variance pre-activations
    moments = []
    for _ in range(8):
        y = phi(y) @ (torch.randn(width, width, generator=g) * gain / math.sqrt(width))
        moments.append(y.pow(2).mean().item())
    assert 0.6 < moments[-1] < 1.6, (
        f"activation_gain({activation!r}) = {gain:.4f}: through 8 layers E[y²] went "
        f"{' -> '.join(f'{m:.3g}' for m in moments)}; it should stay near 1")
