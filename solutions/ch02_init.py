"""Chapter 02 exercises, answered: initialization for layers of unequal width, and the gain of any activation."""

import math

import torch
import torch.nn.functional as F

SCHEMES = ("lecun", "xavier", "kaiming", "kaiming_fan_out")
ACTIVATIONS = {
    "linear": lambda y: y,
    "relu": torch.relu,
    "tanh": torch.tanh,
    "gelu": F.gelu,  # the exact (erf) form, PyTorch's default
    "silu": F.silu,
}


def layer_stds(widths: list[int], scheme: str) -> list[float]:
    """Standard deviation of each weight of a stack of linear layers (see exercises/ch02_init.py)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {SCHEMES}")
    stds = []
    for fan_in, fan_out in zip(widths[:-1], widths[1:]):
        variance = {
            "lecun": 1 / fan_in,  # keeps the forward variance of a linear layer
            "xavier": 2 / (fan_in + fan_out),  # the compromise between forward and backward
            "kaiming": 2 / fan_in,  # ReLU keeps half of the second moment: twice LeCun's variance
            "kaiming_fan_out": 2 / fan_out,  # the same for the gradients flowing back through fan_out units
        }[scheme]
        stds.append(math.sqrt(variance))
    return stds


def activation_gain(activation: str) -> float:
    """1 / √E[φ(z)²] for z ~ N(0, 1) (see exercises/ch02_init.py)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose one of {sorted(ACTIVATIONS)}")
    # E[φ(z)²] = ∫ φ(z)² pdf(z) dz on a fine grid; beyond |z| = 12 the Gaussian weighs nothing in float64.
    z = torch.linspace(-12.0, 12.0, 240_001, dtype=torch.float64)
    pdf = torch.exp(-z**2 / 2) / math.sqrt(2 * math.pi)
    second_moment = torch.trapezoid(ACTIVATIONS[activation](z) ** 2 * pdf, z).item()
    return 1 / math.sqrt(second_moment)
