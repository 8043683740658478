"""How close is close enough: the difference that reduction order alone makes, as a rule per dtype and steps.

A parallel run adds the same numbers as the one-process run in another order (micro-batches accumulated one by one,
partial sums over dp replicas, over tp shards, over pipeline stages), and floating-point addition is not
associative: each reordered sum rounds differently, by about eps = 2^-(mantissa bits) of its size. So "equal" can
only mean "within what reordering explains", and a parity test needs a bound that is

- an upper bound of every reordering the layouts make (or a correct layout fails), and
- far below the smallest real bug (or a bug passes).

The rule (relative error of a loss, a gradient norm, or of a tensor in norm: ||got − want|| / ||want||):

    rel_tol(dtype, steps) = SAFETY · K[dtype] · eps(dtype) · steps

- eps(dtype): torch.finfo(dtype).eps (fp32 2^-23 ≈ 1.19e-7; bf16 2^-7 ≈ 7.8e-3).
- K[dtype]: the largest error of the first step measured by `measure` on the lab's layouts (reversed micro-batch
  order, 4 micro-batches, dp 2 and 4, tp 2, pp 2, dp 2 × tp 2; `minidist.debug.parity_run`), in units of eps:
  fp32 1.39 (step-0 gradients, norm-wise), bf16 0.42 (the same; autocast forward, fp32 gradients and reductions).
- steps: differences enter at every step and are carried by the weights; over the 10 measured steps the fp32
  loss error stayed under 1.9 eps and the bf16 one grew about linearly (7.5e-6 at step 1, 7.5e-5 at step 10),
  so a linear growth bounds both. Beyond ~10 steps training is chaotic; compare early steps.
- SAFETY = 8: other shapes, thread counts and kernels reorder differently; 8× the largest measurement still
  leaves the smallest museum bug (a 7.5e-5 change of the gradient norm: one replicated norm weight counted twice)
  over 50× above the fp32 bound of one step.

Chapter 14 measures all of this again (the tolerance lab) and the tests check the rule against fresh measurements.
"""

from __future__ import annotations

import torch

from minidist.debug import grad_diff

EPS = {"fp32": torch.finfo(torch.float32).eps, "bf16": torch.finfo(torch.bfloat16).eps}
K = {"fp32": 1.4, "bf16": 0.42}  # measured max error of one step, in eps (module docstring)
SAFETY = 8


def rel_tol(dtype: str = "fp32", steps: int = 1) -> float:
    """The largest relative difference reduction order may make after `steps` steps (see the module docstring)."""
    if dtype not in EPS:
        raise ValueError(f"no measured tolerance for dtype {dtype!r}; measured: {', '.join(EPS)}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    return SAFETY * K[dtype] * EPS[dtype] * steps


def close(got: list[float] | torch.Tensor, want: list[float] | torch.Tensor, dtype: str = "fp32",
          steps: int | list[int] | None = None) -> bool:
    """Every got[i] within rel_tol(dtype, steps of figure i) of want[i]. `steps`: None for one figure per step
    (figure i after i + 1 steps), an int for figures all after that many steps, or one step count per figure."""
    got = torch.as_tensor(got, dtype=torch.float64).flatten()
    want = torch.as_tensor(want, dtype=torch.float64).flatten()
    if got.shape != want.shape:
        return False
    if steps is None:
        steps = list(range(1, len(want) + 1))
    count = torch.as_tensor(steps, dtype=torch.float64).expand(want.shape)
    bound = rel_tol(dtype, 1) * count * want.abs()  # the rule grows linearly with the steps
    return bool(((got - want).abs() <= bound).all())


def measure(record: dict, reference: dict) -> dict[str, float | list[float]]:
    """The differences of one run from the reference (records of `parity_run`): the largest norm-wise error of a
    step-0 gradient, and the relative error of the loss and of the gradient norm at every step."""
    report = grad_diff.diff(record["grads"], reference["grads"], tol=0.0)
    return {"grad": max(e.rel for e in report.entries),
            "loss": [abs(a - b) / abs(b) for a, b in zip(record["losses"], reference["losses"])],
            "norm": [abs(a - b) / abs(b) for a, b in zip(record["norms"], reference["norms"])]}
