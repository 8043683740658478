"""Chapter 02 exercises: initialization for layers of unequal width, and the gain of any activation.

Grade your answers with `make grade CH=02`. The grader compares your numbers with `minidist.model.init` and with a
quadrature method the exercise does not ask for, and then does what initialization is for: it builds deep stacks
with your standard deviations and measures whether the signal keeps its size, forward and backward.

The notebook's stacks are square (fan-in = fan-out), where LeCun and Xavier coincide and the direction does not
matter. Here every layer may change the width, and the activation may be anything.

Notation: a linear layer maps fan_in inputs to fan_out outputs, y_j = Σ_i w_ij x_i, weights i.i.d. N(0, σ²).
  forward:  Var(y) = fan_in · σ² · E[x²]
  backward: Var(∂L/∂x) = fan_out · σ² · E[φ'(y)²] · Var(∂L/∂y)
"""

SCHEMES = ("lecun", "xavier", "kaiming", "kaiming_fan_out")


def layer_stds(widths: list[int], scheme: str) -> list[float]:
    """The standard deviation of each weight matrix of a stack whose layer i maps widths[i] -> widths[i + 1].

    Return len(widths) − 1 numbers, one per layer, with fan_in = widths[i] and fan_out = widths[i + 1]:
      "lecun"            σ² = 1 / fan_in                  keeps the forward variance through linear layers
      "xavier"           σ² = 2 / (fan_in + fan_out)      Glorot & Bengio 2010, eq. 12: a compromise between
                                                          the forward (1/fan_in) and backward (1/fan_out) rules
      "kaiming"          σ² = 2 / fan_in                  He et al. 2015, eq. 10: ReLU zeroes half of the
                                                          signal, E[relu(y)²] = Var(y)/2, so twice LeCun's
      "kaiming_fan_out"  σ² = 2 / fan_out                 the same for the backward pass (gradients arrive
                                                          from fan_out units)
    Raise ValueError for any other scheme.

    The grader checks the values, then measures stacks of doubling widths (16 -> 32 -> ... -> 512): "kaiming"
    must keep the forward signal of a ReLU stack flat and "kaiming_fan_out" its gradients; Xavier in a linear
    stack must change the forward second moment by 2·fan_in/(fan_in + fan_out) = 2/3 per layer and the backward
    one by 4/3. Work out on paper why, from the two formulas at the top of the file.

    Hint: return standard deviations, not variances.
    """
    raise NotImplementedError("exercise: one std per layer from fan_in = widths[i], fan_out = widths[i + 1]")


def activation_gain(activation: str) -> float:
    """The gain g for which weights of std g/√fan_in keep unit-variance pre-activations at unit variance.

    A layer after the activation φ computes y' = Σ_i w_i φ(y_i). With y ~ N(0, 1) and σ = g/√fan_in,
    Var(y') = fan_in · σ² · E[φ(y)²] = g² · E[φ(y)²], so g = 1 / √E[φ(z)²], z ~ N(0, 1).

    activation is one of "linear" (φ(z) = z), "relu", "tanh", "gelu" (the exact form, torch.nn.functional.gelu)
    and "silu" (torch.nn.functional.silu); raise ValueError for others. Closed forms exist for two of them:
    linear gives 1 and relu √2 (Kaiming's gain). For the rest, compute the integral
        E[φ(z)²] = ∫ φ(z)² · exp(−z²/2)/√(2π) dz
    numerically, e.g. with torch.trapezoid on a fine float64 grid over [−12, 12] (the Gaussian weighs nothing
    beyond). The grader wants 4 correct digits.

    Note E[φ(z)²], not Var(φ(z)): the next layer's sum does not subtract the mean of a ReLU or GELU output.
    Compare your tanh gain with torch.nn.init.calculate_gain("tanh") = 5/3: PyTorch's is a rule of thumb, this
    one is the fixed point of the variance map for unit inputs. The grader also runs 8 layers of width 512 with
    your gain and checks that E[y²] stays near 1.
    """
    raise NotImplementedError("exercise: 1 / sqrt(E[phi(z)^2]) for z ~ N(0, 1)")
