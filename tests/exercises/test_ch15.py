"""Grade chapter 15's exercises: the B/W split of a linear, the frontier capture of a block, ZB-H1 as data, the V
placement.

`pytest tests/exercises -k ch15` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
The oracles: autograd's fused backward (for the split), the chapter's simulator with `check_complete` and the
makespan formula (for ZB-H1), and `minidist.parallel.pp.schedules.chunk_rank(..., v_shape=True)` (for the V).
Calling or importing minidist's own zero-bubble builders is refused.
"""

import importlib

import pytest
import torch
from counting import CountedIdentity as _Counted
from grading import load

from minidist.parallel.pp import schedules as S
from minidist.parallel.pp import zero_bubble as Z

MODULE = "ch15_zero_bubble"
BUILDERS = ("zb1_order", "zbv_order", "build_any_schedule")
RATIOS = [(1.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 1.0, 1.0), (1.0, 1.0, 0.5)]  # T_F : T_B : T_W with T_W <= T_F


# ---------------------------------------------------------------------------------------------------------------
# 1. The B/W split of a linear
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(6, 5), (2, 3, 5)], ids=["2-D input", "3-D input"])
def test_ch15_deferred_weight_linear(impl: str, shape: tuple[int, ...]) -> None:
    fn = importlib.import_module(f"{impl}.{MODULE}").DeferredWeightLinear
    run_w = load(impl, MODULE, "run_weight_grads")
    gen = torch.Generator().manual_seed(0)
    x0, w0, b0 = torch.randn(shape, generator=gen), torch.randn(4, 5, generator=gen), torch.randn(4, generator=gen)
    dy = torch.randn(*shape[:-1], 4, generator=gen)
    # The fused reference, twice (the second backward accumulates: W must add, not overwrite).
    x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
    for _ in range(2):
        torch.nn.functional.linear(x, w, b).backward(dy)
    xs, ws, bs = (t.clone().requires_grad_() for t in (x0, w0, b0))
    pending: list = []
    for _ in range(2):
        try:
            y = fn.apply(xs, ws, bs, pending)
        except NotImplementedError:
            pytest.fail(f"{impl}.{MODULE}.DeferredWeightLinear is not implemented yet", pytrace=False)
        assert torch.allclose(y, torch.nn.functional.linear(x0, w0, b0), atol=1e-6), (
            f"{shape}: the forward is not x·Wᵀ + b")
        y.backward(dy)
    assert xs.grad is not None and torch.allclose(xs.grad, x.grad, atol=1e-5), (
        f"{shape}: B's input gradient is wrong — dx = dy·W (not dy·Wᵀ: W is [d_out, d_in])")
    assert ws.grad is None and bs.grad is None, (
        f"{shape}: the weight or bias has a gradient after B — B must return None for them and leave dW, db to W")
    assert len(pending) == 2, f"{shape}: B queued {len(pending)} entries for 2 backwards (one per backward)"
    run_w(pending)
    assert not pending, f"{shape}: run_weight_grads left {len(pending)} entries in pending (W runs each once)"
    assert ws.grad is not None and bs.grad is not None, f"{shape}: W set no weight or bias gradient"
    assert ws.grad.shape == w.grad.shape, (
        f"{shape}: dW has shape {tuple(ws.grad.shape)}, expected {tuple(w.grad.shape)} — dW = dyᵀ·x, not xᵀ·dy")
    assert torch.allclose(ws.grad, w.grad, atol=1e-5), (
        f"{shape}: dW is wrong — sum dyᵀ·x over every leading dimension (flatten them), and add to .grad")
    assert torch.allclose(bs.grad, b.grad, atol=1e-5), (
        f"{shape}: db is wrong — the sum of dy over every leading dimension, added to .grad")


# ---------------------------------------------------------------------------------------------------------------
# 2. The frontier capture of a block: two linears and a nonlinearity
# ---------------------------------------------------------------------------------------------------------------


def _block(seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w1, b1 = torch.randn(32, 16, generator=gen) / 4, torch.randn(32, generator=gen)
    w2, b2 = torch.randn(12, 32, generator=gen) / 6, torch.randn(12, generator=gen)
    x, dy = torch.randn(8, 16, generator=gen), torch.randn(8, 12, generator=gen)
    return [w1, b1, w2, b2], x, dy


def _block_forward(params: list[torch.Tensor], x: torch.Tensor, act) -> torch.Tensor:
    w1, b1, w2, b2 = params
    return torch.nn.functional.linear(_Counted.apply(act(torch.nn.functional.linear(x, w1, b1))), w2, b2)


@pytest.mark.parametrize("act", [torch.tanh, torch.nn.functional.gelu], ids=["tanh", "gelu"])
def test_ch15_frontier_split(impl: str, act) -> None:
    split_b, split_w = load(impl, MODULE, "frontier_backward_input"), load(impl, MODULE, "frontier_backward_weight")
    names = ["lin1.weight", "lin1.bias", "lin2.weight", "lin2.bias"]
    values, x0, dy = _block(15)
    earlier = [torch.full_like(v, 0.5) for v in values]  # an earlier micro-batch's gradients: W must add to them

    def fresh():
        params = [v.clone().requires_grad_() for v in values]
        for p, g in zip(params, earlier):
            p.grad = g.clone()
        return params, x0.clone().requires_grad_()

    params, x = fresh()
    _block_forward(params, x, act).backward(dy)
    want_dx, want = x.grad, [p.grad for p in params]

    params, x = fresh()
    out = _block_forward(params, x, act)
    _Counted.runs = 0
    dx, captured = split_b(out, dy, x, params)
    changed = [n for n, p, g in zip(names, params, earlier) if not torch.equal(p.grad, g)]
    assert not changed, (f"frontier_backward_input: {changed} changed after B — B computes the input's gradient "
                         "only (autograd.grad for x), the weights' wait for W")
    assert _Counted.runs == 1, f"frontier_backward_input: the input's path ran {_Counted.runs} times in B, not once"
    assert dx is not None and torch.equal(dx, want_dx), (
        "frontier_backward_input: dx differs from the fused backward's — return autograd.grad's gradient of x")
    try:
        split_w(captured)
    except RuntimeError as error:
        if "second time" in str(error) or "freed" in str(error):
            pytest.fail("frontier_backward_weight: the graph was freed after B — call autograd.grad in B with "
                        f"retain_graph=True ({str(error).splitlines()[0][:80]})", pytrace=False)
        raise
    wrong = [n for n, p, g in zip(names, params, want) if not torch.equal(p.grad, g)]
    if wrong:
        extra = [(p.grad - w).double() for p, w in zip(params, want)]
        twice = all(torch.allclose(e, (w - g).double(), rtol=1e-4, atol=1e-6) or torch.equal(p.grad, w)
                    for e, w, g, p in zip(extra, want, earlier, params))
        hint = (" — the first linear's gradient came twice: one backward call from every frontier with every weight "
                "as inputs walks from the second linear's frontier down the input's path again; make one backward "
                "call per frontier node, with only its own branch's weights" if twice and "lin1.weight" in wrong else
                " — did W add to .grad (an earlier micro-batch's gradient is there), and start from the gradients "
                "each frontier node received in B?")
        pytest.fail(f"frontier_backward_weight: {wrong} differ from the fused backward's (bit for bit){hint}",
                    pytrace=False)
    assert _Counted.runs == 1, (
        f"frontier_backward_weight: the counting identity on the input's path ran again in W ({_Counted.runs} runs "
        "in all, the fused backward runs it once) — start W from the gradients captured at the frontier nodes, "
        "not from the output: torch.autograd.backward(GradientEdge(node, i), received gradient, inputs=weights)")


# ---------------------------------------------------------------------------------------------------------------
# 3. ZB-H1 as data
# ---------------------------------------------------------------------------------------------------------------


def _build(impl: str, pp: int, m: int) -> list[list[S.Action]]:
    module = importlib.import_module(f"{impl}.{MODULE}")
    imported = [n for n, v in vars(module).items() if any(v is getattr(Z, b) for b in BUILDERS)]
    if imported:
        pytest.fail(f"{module.__name__} imports {imported} from minidist.parallel.pp.zero_bubble: build the lists "
                    "yourself", pytrace=False)
    originals = {b: getattr(Z, b) for b in BUILDERS}
    try:
        for b in BUILDERS:
            setattr(Z, b, lambda *a, b=b, **k: pytest.fail(f"{b} builds the schedule for you", pytrace=False))
        return load(impl, MODULE, "zb1_schedule")(pp, m)
    finally:
        for b, f in originals.items():
            setattr(Z, b, f)


def _held(order: list[S.Action]) -> int:
    """The most micro-batches whose F has run and whose W has not."""
    live = peak = 0
    for a in order:
        live += (a.kind == S.F) - (a.kind == S.W)
        peak = max(peak, live)
    return peak


def _w_after_b(schedule: list[list[S.Action]]) -> bool:
    """Whether every W follows its own B directly (among the compute actions): nothing held back."""
    for order in schedule:
        compute = [a for a in order if a.kind in S.COMPUTE]
        for previous, a in zip(compute, compute[1:]):
            if a.kind == S.W and previous != S.Action(S.B, a.mb, a.chunk):
                return False
    return True


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
def test_ch15_zb1_schedule(impl: str, pp: int) -> None:
    for m in range(pp, 2 * pp + 3):
        where = f"zb1_schedule(pp={pp}, microbatches={m})"
        schedule = _build(impl, pp, m)
        assert isinstance(schedule, list) and len(schedule) == pp, f"{where}: expected one list per rank"
        if not any(a.kind == S.W for order in schedule for a in order):
            pytest.fail(f"{where}: no W actions — the backward must be split: B(mb, c) then W(mb, c)", pytrace=False)
        try:
            S.check_complete(schedule, pp, m)
        except ValueError as error:
            pytest.fail(f"{where}: {error}", pytrace=False)
        for t_f, t_b, t_w in RATIOS:
            try:
                timeline = S.simulate(schedule, t_f, t_b, weight=t_w)
            except ValueError as error:
                pytest.fail(f"{where}: the simulator refuses the schedule: {error}", pytrace=False)
            want = Z.zb_makespan("zb1", pp, m, t_f, t_b, t_w)
            hint = (" — every W runs right after its B: the drain still waits; rank r may hold back r W's and run "
                    "one after each B of the cool-down" if _w_after_b(schedule) else
                    " — a rank waits where a held-back W could run, or holds back W's it could have run earlier")
            assert abs(timeline.makespan - want) < 1e-9, (
                f"{where}, T_F:T_B:T_W = {t_f:g}:{t_b:g}:{t_w:g}: the step takes {timeline.makespan:g}, expected "
                f"m(T_F+T_B+T_W) + (p−1)(T_F+T_B−T_W) = {want:g}{hint}")
        held = [_held(order) for order in schedule]
        assert max(held) <= pp, (
            f"{where}: micro-batches held from F to W per rank {held}, ZB-H1 holds at most p = {pp} (1F1B's peak) — "
            "rank r may owe at most r W's")


# ---------------------------------------------------------------------------------------------------------------
# 4. The V placement
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_ch15_v_placement(impl: str, pp: int) -> None:
    chunk_rank, rank_chunks = load(impl, MODULE, "v_chunk_rank"), load(impl, MODULE, "v_rank_chunks")
    for c in range(2 * pp):
        want = S.chunk_rank(c, pp, v_shape=True)
        got = chunk_rank(c, pp)
        hint = (" — that is the loop placement (c mod p) of interleaved 1F1B; the V comes back up"
                if got == c % pp else " — the second leg counts down from p−1: chunk 2p−1 is rank 0's")
        assert got == want, f"v_chunk_rank({c}, pp={pp}) = {got}, expected {want}{hint}"
    for r in range(pp):
        got = list(rank_chunks(r, pp))
        assert got == [r, 2 * pp - 1 - r], (
            f"v_rank_chunks({r}, pp={pp}) = {got}, expected {[r, 2 * pp - 1 - r]} (model order, each c with "
            "v_chunk_rank(c) = r)")
    got = sorted(load(impl, MODULE, "local_boundaries")(pp))
    want = [(c, c + 1) for c in range(2 * pp - 1) if S.chunk_rank(c, pp, True) == S.chunk_rank(c + 1, pp, True)]
    assert got == want, (
        f"local_boundaries(pp={pp}) = {got}, expected {want} — only the bottom of the V stays on one rank; rank 0 "
        "holds the first and the last chunk, but they are not neighbours")
