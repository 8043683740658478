"""Grade chapter 14's exercises: the first flagged layer of a gradient diff, and a ledger against its formulas.

`pytest tests/exercises -k ch14` grades solutions/ (the default); add `--impl exercises` to grade your own answers
(`make grade CH=14`). The oracles: the chapter's tiny model's gradients with a difference placed here, the museum's
bugs (each with the parameters it must be localized to), and a real Ledger filled here with known bytes.
"""

import math

import pytest
import torch
from grading import load

from minidist.comm.communicator import Ledger
from minidist.debug import museum, tolerance
from minidist.debug import parity_run as pr

MODULE = "ch14_debugging"


@pytest.fixture(scope="module")
def grads() -> dict[str, torch.Tensor]:
    return pr.run_local(pr.Setup())["grads"]


def test_ch14_first_flagged(impl: str, grads: dict[str, torch.Tensor]) -> None:
    first_flagged = load(impl, MODULE, "first_flagged")
    tol = tolerance.rel_tol("fp32", 1)
    names = list(grads)
    assert first_flagged(dict(grads), grads, tol) is None, "first_flagged: identical gradients must give None"
    got = {name: grads[name].clone() for name in reversed(names)}  # the reference's order decides, not got's
    early, middle, last = names[len(names) // 4], names[len(names) // 2], names[-1]
    got[early] = got[early] + 0.01 * got[early].norm() / math.sqrt(got[early].numel())  # first in model order
    got[middle] = got[middle] * 11  # the largest error
    got[last] = got[last] * 2  # the first in got's (reversed) order
    found = first_flagged(got, grads, tol)
    hints = {last: " — that is the first in got's order: walk `want`'s order (the model's), not got's",
             middle: " — that is the largest error: return the first parameter over tol in model order, not the worst"}
    assert found is not None and found[0] == early, (
        f"first_flagged: expected {early} (the first over tol in the reference's model order), got {found}"
        + (hints.get(found[0], "") if found else " — three parameters are off by more than tol"))
    assert found[1] == pytest.approx(0.01 * grads[early].norm().item() / grads[early].norm().item(), rel=1e-3), (
        f"first_flagged: rel must be ||got - want|| / ||want||, got {found[1]}")
    got[early] = grads[early].clone()
    got[middle] = grads[middle].clone()
    del got[middle]
    assert first_flagged(got, grads, tol) == (middle, math.inf), "first_flagged: a missing gradient is (name, inf)"


def test_ch14_first_flagged_finds_each_museum_bug(impl: str) -> None:
    """The museum's one-process-vs-2-ranks records for two gradient bugs, built here on 2 ranks."""
    first_flagged = load(impl, MODULE, "first_flagged")
    reference = pr.run_local(pr.Setup())
    names = ("pipeline_missing_1_over_m", "token_vs_sample_mean")
    setups = [pr.Setup(museum.BUGS[n].layout, bug=n, label=n) for n in names]
    for name, record in zip(names, pr.run_many(setups)):
        want = museum.expected_layer(name, list(reference["grads"]))[0]
        found = first_flagged(record["grads"], reference["grads"], tolerance.rel_tol("fp32", 1))
        assert found is not None and found[0] == want, f"first_flagged on {name}: expected {want}, got {found}"


def test_ch14_ledger_diff(impl: str) -> None:
    ledger_diff = load(impl, MODULE, "ledger_diff")
    ledger = Ledger()
    ledger.record("all_reduce", "dp_cp", 1000)
    ledger.record("all_reduce", "tp", 64, calls=4)
    ledger.record("all_gather", "tp", 32)
    expected = {("all_reduce", "dp_cp"): 1000, ("all_reduce", "tp"): 64, ("all_gather", "tp"): 32}
    assert ledger_diff(ledger.totals(), expected) == [], "ledger_diff: a ledger equal to its formulas gives []"
    expected[("all_reduce", "dp_cp")] = 1200
    expected[("reduce_scatter", "dp_cp")] = 500
    del expected[("all_gather", "tp")]
    got = ledger_diff(ledger.totals(), expected)
    want = [("all_gather", "tp", 32, 0), ("all_reduce", "dp_cp", 1000, 1200), ("reduce_scatter", "dp_cp", 0, 500)]
    assert got == want, f"ledger_diff: expected {want} (sorted; missing sides count 0 bytes), got {got}"


# ------------------------------------------------------------------------------------------------------------------
# A tolerance derived from Higham's bound, tested on data no constant was fitted to


@pytest.mark.parametrize("n,dtype", [(1000, torch.float32), (100, torch.float16), (10, torch.bfloat16),
                                     (2**20, torch.float32)], ids=["fp32-n1000", "fp16-n100", "bf16-n10", "fp32-n1M"])
def test_ch14_gamma(impl: str, n: int, dtype: torch.dtype) -> None:
    gamma = load(impl, MODULE, "gamma")
    u = torch.finfo(dtype).eps / 2
    want = n * u / (1 - n * u)
    got = gamma(n, dtype)
    if got != pytest.approx(want, rel=1e-12):
        eps = 2 * u
        hint = ""
        if got == pytest.approx(n * eps / (1 - n * eps), rel=1e-9) or got == pytest.approx(2 * want, rel=1e-9):
            hint = " — you used the machine epsilon; Higham's u is the unit roundoff, eps / 2 under round-to-nearest"
        elif got == pytest.approx(n * u, rel=1e-12):
            hint = " — n·u is only the first-order term: γ_n = n·u / (1 − n·u)"
        elif got == pytest.approx((n - 1) * u / (1 - (n - 1) * u), rel=1e-12):
            hint = " — that is γ_{n−1} (the sum's n − 1 additions); the exercise, like Higham's dot product, uses γ_n"
        pytest.fail(f"gamma({n}, {dtype}): {got!r}, expected {want!r}{hint}", pytrace=False)


def test_ch14_gamma_refuses_n_u_at_least_one(impl: str) -> None:
    gamma = load(impl, MODULE, "gamma")
    try:
        got = gamma(300, torch.bfloat16)  # u = 2^-8: n·u = 1.17
    except ValueError:
        return
    pytest.fail(f"gamma(300, bfloat16) returned {got!r}: n·u = 1.17 ≥ 1, where the bound says nothing (and n·u / "
                "(1 − n·u) turns negative) — raise ValueError", pytrace=False)


def _sequential_sum(terms: torch.Tensor) -> torch.Tensor:
    """Left to right, rounding to the terms' dtype after every addition (the worst order for a long sum)."""
    total = torch.zeros((), dtype=terms.dtype)
    for t in terms:
        total = total + t
    return total


def _dot_case(name: str):
    g = torch.Generator().manual_seed(len(name))
    if name == "fp32 random, n=4096":
        x, y = torch.randn(4096, generator=g), torch.randn(4096, generator=g)
        return x, y, torch.float32, torch.dot(x, y).double()
    if name == "fp32 cancelling (1e4 − 1e4 + small terms)":
        x = torch.cat([torch.tensor([1e4, -1e4]), torch.rand(62, generator=g) * 1e-3])
        y = torch.ones_like(x) + torch.rand(64, generator=g) * 1e-6
        return x, y, torch.float32, _sequential_sum(x * y).double()
    if name == "fp16 sequential, n=256":
        x, y = torch.rand(256, generator=g).half(), torch.rand(256, generator=g).half()
        return x, y, torch.float16, _sequential_sum(x * y).double()
    x = (torch.randn(128, generator=g) * 100).half()  # "fp16 cancelling": a sum far smaller than its terms
    y = torch.ones(128, dtype=torch.float16)
    x[-1] = -x[:-1].double().sum().clamp(-6e4, 6e4).half()
    return x, y, torch.float16, _sequential_sum(x * y).double()


DOT_CASES = ["fp32 random, n=4096", "fp32 cancelling (1e4 − 1e4 + small terms)", "fp16 sequential, n=256",
             "fp16 cancelling"]


@pytest.mark.parametrize("name", DOT_CASES)
def test_ch14_dot_error_bound_holds_and_is_the_derived_one(impl: str, name: str) -> None:
    bound = load(impl, MODULE, "dot_error_bound")
    x, y, dtype, computed = _dot_case(name)
    exact = (x.double() * y.double()).sum()
    error = (computed - exact).abs().item()
    got = bound(x, y, dtype)
    u = torch.finfo(dtype).eps / 2
    n = x.numel()
    terms = (x.double().abs() * y.double().abs()).sum().item()
    want = n * u / (1 - n * u) * terms
    where = f"dot_error_bound, case {name!r} (measured error {error:.3e})"
    if error > got:
        hint = (" — scaled by |xᵀy|, the result: under cancellation the result is small and the errors are those "
                "of the terms; scale by Σ|x_i y_i|" if got <= 2 * gamma_of(n, dtype) * abs(exact.item()) + 1e-300
                else "")
        pytest.fail(f"{where}: the bound {got:.3e} is below the measured error{hint}", pytrace=False)
    if got != pytest.approx(want, rel=1e-9):
        if got == pytest.approx(2 * want, rel=1e-6):
            hint = " — twice the derived bound: u = eps / 2"
        elif got == pytest.approx(gamma_of(n, dtype) * abs(exact.item()), rel=1e-6):
            hint = (" — scaled by |xᵀy|, the result: the rounding errors are those of the terms; scale by "
                    "Σ|x_i y_i| (it fails outright under cancellation)")
        else:
            hint = " — not γ_n Σ|x_i y_i|: a padded constant is a guess, not a derivation"
        pytest.fail(f"{where}: {got:.6e}, expected {want:.6e}{hint}", pytrace=False)


def gamma_of(n: int, dtype: torch.dtype) -> float:
    u = torch.finfo(dtype).eps / 2
    return n * u / (1 - n * u)


MATMUL_CASES = [("fp32, n=64, tp 2 split sums", 64, torch.float32, "split2"),
                ("fp32, n=1000, tp 4 split sums", 1000, torch.float32, "split4"),
                ("fp32, n=4096, reversed order", 4096, torch.float32, "reversed"),
                ("bf16, n=128, tp 8 split sums rounded to bf16", 128, torch.bfloat16, "split8")]


@pytest.mark.parametrize("name,n,dtype,how", MATMUL_CASES, ids=[c[0] for c in MATMUL_CASES])
def test_ch14_reordered_matmul_tolerance(impl: str, name: str, n: int, dtype: torch.dtype, how: str) -> None:
    tolerance_fn = load(impl, MODULE, "reordered_matmul_tolerance")
    g = torch.Generator().manual_seed(n)
    a = torch.randn(8, n, generator=g).to(dtype)
    b = torch.randn(n, 6, generator=g).to(dtype)
    one = a @ b
    if how == "reversed":
        other = a.flip(1) @ b.flip(0)
    else:
        parts = int(how[5:])
        other = sum(pa @ pb for pa, pb in zip(a.chunk(parts, dim=1), b.chunk(parts, dim=0)))
    differ = (one.double() - other.double()).abs()
    got = torch.as_tensor(tolerance_fn(a, b, dtype), dtype=torch.float64)
    want = 2 * gamma_of(n, dtype) * (a.double().abs() @ b.double().abs())
    where = f"reordered_matmul_tolerance, case {name!r}"
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)}, expected one tolerance per output element"
    if (differ > got).any():
        pytest.fail(f"{where}: two orderings differ by up to {differ.max().item():.3e}, more than your tolerance "
                    f"there — each is within γ_n|A||B| of the exact product, so they can be twice that apart",
                    pytrace=False)
    if not torch.allclose(got, want, rtol=1e-9, atol=0):
        hint = (" — one computation's bound: two computations, each that far from the exact product on opposite "
                "sides, are twice as far apart" if torch.allclose(got, want / 2, rtol=1e-9, atol=0) else
                " — not 2 γ_n |A||B| elementwise (|A||B|: the matmul of the magnitudes, n the inner dimension)")
        pytest.fail(f"{where}: the tolerance holds here but is not the derived one{hint}", pytrace=False)
