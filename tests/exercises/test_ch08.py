"""Grade chapter 08's exercises: column- and row-parallel linears (with f, g, gather, scatter), and the
vocab-parallel cross-entropy, on 2 and 3 real ranks.

`pytest tests/exercises -k ch08` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
The oracle is the unsplit computation in one process, in float64: `F.linear` with the full weight and
`F.cross_entropy` with the full logits, values and gradients. The collectives are counted: the Megatron MLP must
cost one all-reduce forward and one backward, and the cross-entropy only all-reduces of at most 3 numbers per token.
"""

import importlib
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minidist.comm.launch import run_ranks

MODULE = "ch08_tensor_parallel"
LEAD, IN, OUT, HIDDEN = (2, 3), 12, 18, 24  # every width divides by 2 and by 3
# (vocabulary, logit scale): 51 splits unevenly over 2 ranks, 50 over 3; scale 1000 overflows exp() without the max.
CE_CASES = [(51, 3.0), (50, 3.0), (51, 1000.0)]
N_TOKENS = 23
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "broadcast", "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv")


class Forbidden(AssertionError):
    """A collective the exercise must not use was called (on every rank alike: they run the same code)."""


@contextmanager
def _collectives(log: list, phase: list, allowed: tuple[str, ...]):
    """Record every collective as (name, elements, phase) in `log`; the ones not `allowed` raise."""
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def wrap(name, original):
        def call(*args, **kwargs):
            if name not in allowed:
                raise Forbidden(f"dist.{name} is not allowed here (only {', '.join(allowed)})")
            tensor = args[0] if torch.is_tensor(args[0]) else args[1]
            log.append((name, tensor.numel(), phase[0]))
            return original(*args, **kwargs)
        return call

    try:
        for name, original in saved.items():
            setattr(dist, name, wrap(name, original))
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)


def _full(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


def _linear_cases(column, row, rank: int, p: int) -> dict:
    x, w_col, b_col, w_row, b_row = (_full(1, *LEAD, IN), _full(2, OUT, IN), _full(3, OUT), _full(4, OUT, IN),
                                     _full(5, OUT))
    upstream_full = _full(6, *LEAD, OUT)  # the loss is Σ upstream · y
    mine = slice(rank * OUT // p, (rank + 1) * OUT // p)
    cols = slice(rank * IN // p, (rank + 1) * IN // p)
    out, log, phase = {}, [], ["forward"]

    def reference(w, b, x_full):
        xs, ws, bs = _leaf(x_full), _leaf(w), _leaf(b)
        y = F.linear(xs, ws, bs)
        (y * upstream_full).sum().backward()
        return y.detach(), xs.grad, ws.grad, bs.grad

    with _collectives(log, phase, ("all_reduce", "all_gather")):
        for gather in (True, False):
            y_ref, dx, dw, db = reference(w_col, b_col, x)
            xs, ws, bs = _leaf(x), _leaf(w_col[mine]), _leaf(b_col[mine])
            phase[0] = "forward"
            y = column(xs, ws, bs, None, gather_output=gather)
            phase[0] = "backward"
            (y * (upstream_full if gather else upstream_full[..., mine])).sum().backward()
            out[f"column_parallel_linear(gather_output={gather})"] = {
                "output": (y.detach(), y_ref if gather else y_ref[..., mine]), "x.grad": (xs.grad, dx),
                "weight.grad": (ws.grad, dw[mine]), "bias.grad": (bs.grad, db[mine]), "bias": b_col[mine]}
        for parallel in (True, False):
            y_ref, dx, dw, db = reference(w_row, b_row, x)
            xs, ws, bs = _leaf(x[..., cols] if parallel else x), _leaf(w_row[:, cols]), _leaf(b_row)
            phase[0] = "forward"
            y = row(xs, ws, bs, None, input_is_parallel=parallel)
            phase[0] = "backward"
            (y * upstream_full).sum().backward()
            out[f"row_parallel_linear(input_is_parallel={parallel})"] = {
                "output": (y.detach(), y_ref), "x.grad": (xs.grad, dx[..., cols] if parallel else dx),
                "weight.grad": (ws.grad, dw[:, cols]), "bias.grad": (bs.grad, db), "bias": b_row}
    return out


def _mlp_case(column, row, rank: int, p: int) -> dict:
    x, A, a, B, b = _full(11, *LEAD, IN), _full(12, HIDDEN, IN), _full(13, HIDDEN), _full(14, IN, HIDDEN), _full(15, IN)
    upstream = _full(16, *LEAD, IN)
    hidden = slice(rank * HIDDEN // p, (rank + 1) * HIDDEN // p)
    full = [_leaf(t) for t in (x, A, a, B, b)]
    z_ref = F.linear(F.gelu(F.linear(full[0], full[1], full[2])), full[3], full[4])
    (z_ref * upstream).sum().backward()
    xs, As, as_, Bs, bs = _leaf(x), _leaf(A[hidden]), _leaf(a[hidden]), _leaf(B[:, hidden]), _leaf(b)
    log, phase = [], ["forward"]
    with _collectives(log, phase, ("all_reduce", "all_gather")):
        z = row(F.gelu(column(xs, As, as_, None, gather_output=False)), Bs, bs, None, input_is_parallel=True)
        phase[0] = "backward"
        (z * upstream).sum().backward()
    return {"output": (z.detach(), z_ref.detach()), "x.grad": (xs.grad, full[0].grad),
            "A.grad": (As.grad, full[1].grad[hidden]), "B.grad": (Bs.grad, full[3].grad[:, hidden]),
            "b.grad": (bs.grad, full[4].grad), "log": log}


def _ce_case(ce, rank: int, p: int, vocab: int, scale: float) -> dict:
    logits = _full(21, N_TOKENS, vocab) * scale
    g = torch.Generator().manual_seed(22)
    targets = torch.randint(0, vocab, (N_TOKENS,), generator=g)
    bounds = [len(c) for c in torch.arange(vocab).tensor_split(p)]
    starts = [sum(bounds[:r]) for r in range(p)]
    targets[:p] = torch.tensor(starts)  # the first token of every shard, and the last ones
    targets[p:2 * p] = torch.tensor([s + n - 1 for s, n in zip(starts, bounds)])
    targets[2 * p::5] = -100  # ignored
    weights = _full(23, N_TOKENS).abs() + 0.1  # back-propagate a weighted sum: the incoming gradient matters
    full = _leaf(logits)
    F.cross_entropy(full, targets, reduction="none").mul(weights).sum().backward()
    ref = F.cross_entropy(logits, targets, reduction="none")
    local = _leaf(logits[:, starts[rank]:starts[rank] + bounds[rank]])
    log, phase = [], ["forward"]
    with _collectives(log, phase, ("all_reduce",)):
        losses = ce(local, targets, starts[rank], None, ignore_index=-100)
        phase[0] = "backward"
        losses.mul(weights).sum().backward()
    return {"losses": (losses.detach(), ref), "logits.grad": (local.grad, full.grad[:, starts[rank]:starts[rank]
                                                                                     + bounds[rank]]),
            "log": log, "ignored": int((targets == -100).sum())}


def grade_worker(impl: str) -> dict:
    """On every rank: every case of the chapter; a function not implemented yet gives None (on every rank alike)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    module = importlib.import_module(f"{impl}.{MODULE}")
    graded = {}
    for name, run in (("linears", lambda: _linear_cases(module.column_parallel_linear, module.row_parallel_linear,
                                                        rank, p)),
                      ("mlp", lambda: _mlp_case(module.column_parallel_linear, module.row_parallel_linear, rank, p)),
                      ("cross_entropy", lambda: {(v, s): _ce_case(module.vocab_parallel_cross_entropy, rank, p, v, s)
                                                 for v, s in CE_CASES})):
        try:
            graded[name] = run()
        except NotImplementedError as error:
            tb = error.__traceback__
            while tb.tb_next is not None:  # the stub that raised
                tb = tb.tb_next
            graded[name] = f"{impl}.{MODULE}.{tb.tb_frame.f_code.co_name} is not implemented yet"
        except Forbidden as error:
            graded[name] = f"{impl}.{MODULE}, grading {name}: {error}"
        except Exception as error:
            raise RuntimeError(f"rank {rank} of {p}, grading {name}: {type(error).__name__}: {error}") from error
    return graded


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"world{p}")
def graded(request: pytest.FixtureRequest, impl: str) -> tuple[int, list[dict]]:
    world = request.param
    case = (f"world {world}: {impl}.{MODULE} column/row-parallel linears on x {(*LEAD, IN)} -> {OUT}, an MLP "
            f"{IN} -> {HIDDEN} -> {IN}, and the cross-entropy for (vocab, logit scale) {CE_CASES}")
    return world, run_ranks(grade_worker, world, impl, timeout=90, case=case)


def _results(graded: tuple[int, list[dict]], key: str, impl: str) -> tuple[int, list]:
    world, per_rank = graded
    if isinstance(per_rank[0][key], str):
        pytest.fail(per_rank[0][key], pytrace=False)
    return world, [r[key] for r in per_rank]


def _check(where: str, what: str, got: torch.Tensor | None, want: torch.Tensor, hint=None) -> None:
    """`got` must equal `want`; `hint` (a string, or a function of got and want) explains a likely cause."""
    assert got is not None, f"{where}: {what} is None — is the tensor still connected to the autograd graph?"
    assert got.shape == want.shape, f"{where}: {what} has shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not torch.allclose(got, want, rtol=1e-9, atol=1e-9):
        err = (got - want).abs().max().item()
        why = hint(got, want) if callable(hint) else (hint or "")
        pytest.fail(f"{where}: {what}: off from the unsplit computation by up to {err:.3g}{why}", pytrace=False)


def _linear_hint(what: str, got: torch.Tensor, want: torch.Tensor, world: int, bias: torch.Tensor) -> str:
    if what == "output" and bias.shape[-1] == got.shape[-1] and torch.allclose(got - want, (world - 1) * bias):
        return f" — by exactly {world - 1} x the bias: add the bias once, after the all-reduce"
    if torch.allclose(got, world * want):
        return f" — exactly {world}x too large: something is summed over the ranks twice (or where it is replicated)"
    if what == "x.grad":
        return (" — the input gradient of each rank's matmul is a partial sum: f (column) sums it in backward; a "
                "replicated input of a row-parallel layer needs scatter, whose backward all-gathers the slices")
    return ""


def test_ch08_column_and_row_parallel_linear(graded: tuple[int, list[dict]], impl: str) -> None:
    world, per_rank = _results(graded, "linears", impl)
    for rank, cases in enumerate(per_rank):
        for case, result in cases.items():
            where = f"{case} on rank {rank} of {world}"
            for what in ("output", "x.grad", "weight.grad", "bias.grad"):
                got, want = result[what]
                _check(where, what, got, want,
                       lambda g, w, what=what, b=result["bias"]: _linear_hint(what, g, w, world, b))


def test_ch08_megatron_mlp(graded: tuple[int, list[dict]], impl: str) -> None:
    world, per_rank = _results(graded, "mlp", impl)
    for rank, result in enumerate(per_rank):
        where = f"column_parallel_linear -> GeLU -> row_parallel_linear (MLP {IN} -> {HIDDEN} -> {IN}), rank {rank} " \
                f"of {world}"
        for what in ("output", "x.grad", "A.grad", "B.grad", "b.grad"):
            _check(where, what, *result[what])
        calls = {phase: [(name, n) for name, n, ph in result["log"] if ph == phase]
                 for phase in ("forward", "backward")}
        tokens = LEAD[0] * LEAD[1]
        assert calls["forward"] == [("all_reduce", tokens * IN)], (
            f"{where}: forward collectives {calls['forward']}, expected one all-reduce of the {tokens} x {IN} output "
            "(g) — nothing moves between a column-parallel layer and the row-parallel one that reads its features")
        assert calls["backward"] == [("all_reduce", tokens * IN)], (
            f"{where}: backward collectives {calls['backward']}, expected one all-reduce of the input's gradient "
            f"{tokens} x {IN} (f) — g's backward is the identity")


def test_ch08_vocab_parallel_cross_entropy(graded: tuple[int, list[dict]], impl: str) -> None:
    world, per_rank = _results(graded, "cross_entropy", impl)
    for rank, cases in enumerate(per_rank):
        for (vocab, scale), result in cases.items():
            where = (f"vocab_parallel_cross_entropy on rank {rank} of {world}, vocabulary {vocab} (shards "
                     f"{[len(c) for c in torch.arange(vocab).tensor_split(world)]}), logits x {scale}, "
                     f"{N_TOKENS} tokens of which {result['ignored']} ignored")
            got, want = result["losses"]
            shape = None if got is None else tuple(got.shape)
            assert shape == tuple(want.shape), \
                f"{where}: returned shape {shape}, expected per-token losses of shape {tuple(want.shape)}"
            if not torch.isfinite(got).all():
                pytest.fail(f"{where}: non-finite losses — subtract the global max (all-reduce MAX) before exp()",
                            pytrace=False)
            _check(where, "the per-token losses", got, want,
                   " — loss = log Σ exp(z − m) − (z_t − m), with both sums over all ranks; 0 at ignored tokens")
            _check(where, "the gradient of the local logits", *result["logits.grad"],
                   hint=" — softmax − one-hot on the rank's own columns, times the incoming gradient of each loss, "
                        "0 at ignored tokens")
            forward = [(name, n) for name, n, phase in result["log"] if phase == "forward"]
            backward = [(name, n) for name, n, phase in result["log"] if phase == "backward"]
            assert not backward, f"{where}: the backward communicated {backward}; the gradient is local"
            assert sum(n for _, n in forward) <= 3 * N_TOKENS, (
                f"{where}: the forward all-reduced {sum(n for _, n in forward)} numbers, more than 3 per token "
                f"({3 * N_TOKENS}): the full logits must never cross the wire")
