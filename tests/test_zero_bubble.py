"""Zero-bubble pipelines (chapter 15): the backward split into B and W, ZB-H1 and ZB-V as data, and their runs.

No process group here: the split is checked bit for bit against the fused backward, the schedules against the
simulator and the NCCL-order replay, and the one-rank runs against the reference. The multi-process parity of the
new schedules runs in tests/test_pipeline.py's launches (one per world size).
"""

from __future__ import annotations

import itertools

import parity
import pytest
import torch
from counting import CountedIdentity as _Counted

from minidist.comm.communicator import Comm
from minidist.model import build_model
from minidist.parallel.pp.nccl_model import replay
from minidist.parallel.pp.p2p import peer_of, posting_order
from minidist.parallel.pp.pipeline import PipelineRunner, partition_model, validate_pipeline
from minidist.parallel.pp.schedules import (
    SEND_B,
    SEND_F,
    Action,
    B,
    W,
    check_complete,
    chunk_owners,
    forward_only,
    simulate,
)
from minidist.parallel.pp.split_backward import (
    backward_input,
    backward_input_simple,
    backward_weight,
    backward_weight_simple,
)
from minidist.parallel.pp.zero_bubble import build_any_schedule, zb_bubble_formula, zb_makespan
from minidist.plan.stages import built_in_flight

# ---------------------------------------------------------------------------------------------------------------
# The split: B + W = the fused backward, bit for bit, and W does not walk the input's path again
# ---------------------------------------------------------------------------------------------------------------


def _chunk_backward(mode: str, chunk: int, pp: int = 2) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    stage = partition_model(build_model(parity.CFG, seed=parity.SEED), chunk, pp)
    inputs, targets = parity.global_batch(0)
    gen = torch.Generator().manual_seed(7)
    x = inputs if chunk == 0 else torch.randn(*inputs.shape, parity.CFG.d_model, generator=gen, requires_grad=True)
    out = stage.forward_chunk(chunk, x)
    last = chunk == pp - 1
    out, grad = (stage.loss_fn(out, targets), None) if last else (out, torch.randn(out.shape, generator=gen))
    leaves = [x] if chunk > 0 else []
    if mode == "fused":
        torch.autograd.backward([out], [grad])
        dx = [x.grad] if chunk > 0 else []
    elif mode == "split":
        dx, work = backward_input([out], [grad], leaves)
        assert all(p.grad is None for p in stage.parameters()), "B must not touch the weights' gradients"
        backward_weight(work)
    else:
        grads = [torch.ones_like(out) if grad is None else grad]
        dx = backward_input_simple([out], grads, leaves)
        backward_weight_simple([out], grads, list(stage.parameters()))
    return (dx[0] if dx else None), {n: p.grad for n, p in stage.named_parameters()}


@pytest.mark.parametrize("chunk,pp", [(0, 2), (1, 2), (1, 3)])  # the first chunk, the last, a middle one
@pytest.mark.parametrize("mode", ["split", "simple"])
def test_b_then_w_equals_the_fused_backward_bit_for_bit(mode: str, chunk: int, pp: int) -> None:
    want_dx, want = _chunk_backward("fused", chunk, pp)
    got_dx, got = _chunk_backward(mode, chunk, pp)
    if want_dx is not None:
        assert torch.equal(got_dx, want_dx), f"{mode} chunk {chunk}: the input's gradient differs"
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), f"{mode} chunk {chunk}: {name}"


def test_w_runs_no_node_of_the_input_path_again() -> None:
    # Three linears, a counting identity between each: the simple split walks the input's path twice.
    layers = [torch.nn.Linear(8, 8) for _ in range(3)]
    x = torch.randn(4, 8, requires_grad=True)

    def forward():
        h = x
        for layer in layers:
            h = _Counted.apply(layer(h))
        return h.square().sum()

    _Counted.runs = 0
    dx, work = backward_input([forward()], [None], [x])
    assert _Counted.runs == 3
    backward_weight(work)
    assert _Counted.runs == 3, "W re-ran nodes on the input's path"
    _Counted.runs = 0
    loss = forward()
    backward_input_simple([loss], [torch.ones(())], [x])
    backward_weight_simple([loss], [torch.ones(())], [p for layer in layers for p in layer.parameters()])
    assert _Counted.runs == 6  # the simple way: every node on the path, twice


# ---------------------------------------------------------------------------------------------------------------
# The schedules as data, against the simulator
# ---------------------------------------------------------------------------------------------------------------

RATIOS = [(1, 1, 1), (1, 2, 1), (2, 1, 1), (1, 1, 0.5), (1, 2, 2), (2, 2, 1), (1, 1, 2),  # T_F : T_B : T_W
          (1, 0.5, 1), (3, 0.5, 1), (3, 1, 0.5), (0.5, 3, 1)]  # and far from equal: every term of the max
GRID = [("zb1", p, m) for p in range(1, 7) for m in range(p, 3 * p + 2)] + [
    ("zbv", p, m) for p in range(1, 7) for m in range(2 * p, 3 * p + 2)]


def test_dualpipev_is_complete_and_its_bubble_is_zbvs_at_equal_costs_and_no_more_unless_t_b_dominates() -> None:
    for p in range(1, 7):
        for m in range(2 * p, 3 * p + 2):
            actions = build_any_schedule("dualpipev", p, m)
            check_complete(actions, p, m, 2, v_shape=True)
            assert chunk_owners(actions) == {c: min(c, 2 * p - 1 - c) for c in range(2 * p)}
            # 2p + 1 chunk activations on every rank: ZB-V's 2p, and the forward of an (F, B) pair runs first
            assert list(built_in_flight("dualpipev", p, m)) == [2 * p + 1] * p, (p, m)
            equal = simulate(actions, 0.5, 0.5, weight=0.5)
            assert equal.makespan == pytest.approx(zb_makespan("dualpipev", p, m, 1, 1, 1), rel=1e-12)
            assert equal.makespan == pytest.approx(zb_makespan("zbv", p, m, 1, 1, 1), rel=1e-12)
            assert equal.bubble_fraction() == pytest.approx(zb_bubble_formula("dualpipev", p, m), abs=1e-12)
            for t_f, t_b, t_w in itertools.product((1, 2, 3), repeat=3):  # the measured relation to ZB-V
                extra = simulate(actions, t_f / 2, t_b / 2, weight=t_w / 2).makespan - m * (t_f + t_b + t_w)
                zbv = zb_makespan("zbv", p, m, t_f, t_b, t_w) - m * (t_f + t_b + t_w)
                if t_b < t_f or t_b <= t_w:
                    assert extra <= zbv + 1e-9, (p, m, (t_f, t_b, t_w))
                elif (t_f, t_b, t_w) == (1, 2, 1) and p >= 3:  # where B dominates, ZB-V's held W's win
                    assert extra > zbv, (p, m)
    with pytest.raises(ValueError, match="closed form only"):
        zb_makespan("dualpipev", 2, 4, 1, 2, 1)


def test_every_zero_bubble_schedule_is_complete_and_matches_its_makespan_formula() -> None:
    for schedule, p, m in GRID:
        v = 2 if schedule == "zbv" else 1
        actions = build_any_schedule(schedule, p, m)
        check_complete(actions, p, m, v, v_shape=schedule == "zbv")
        assert chunk_owners(actions) == ({c: min(c, 2 * p - 1 - c) for c in range(2 * p)} if v == 2
                                         else {c: c for c in range(p)})
        for t_f, t_b, t_w in RATIOS:  # costs per micro-batch per rank; a chunk costs 1/v of them
            timeline = simulate(actions, t_f / v, t_b / v, weight=t_w / v)
            assert timeline.makespan == pytest.approx(zb_makespan(schedule, p, m, t_f, t_b, t_w), rel=1e-12), (
                schedule, p, m, (t_f, t_b, t_w))
            assert timeline.bubble_fraction() == pytest.approx(zb_bubble_formula(schedule, p, m, t_f, t_b, t_w),
                                                               abs=1e-12)
        # Peak activations: ZB-H1 p micro-batches on every rank (1F1B's rank 0), ZB-V 2p half-stage chunks.
        assert list(built_in_flight(schedule, p, m)) == [v * p] * p, (schedule, p, m)


def test_zb1_has_a_third_of_1f1bs_bubble_and_zbv_a_sixth_at_equal_costs() -> None:
    for p, m in itertools.product(range(2, 7), range(2, 13)):
        if m < p:
            continue
        one_f_one_b = simulate(build_any_schedule("1f1b", p, m), 1.0, 2.0)  # B = B + W fused
        assert one_f_one_b.makespan == pytest.approx(zb_makespan("1f1b", p, m, 1, 1, 1))
        extra_1f1b = one_f_one_b.makespan - 3 * m
        extra_zb1 = simulate(build_any_schedule("zb1", p, m), 1.0, 1.0, weight=1.0).makespan - 3 * m
        assert extra_zb1 == pytest.approx(extra_1f1b / 3)
        if m >= 2 * p:
            extra_zbv = simulate(build_any_schedule("zbv", p, m), 0.5, 0.5, weight=0.5).makespan - 3 * m
            assert extra_zbv == pytest.approx(extra_1f1b / 6)


def test_w_before_its_b_is_caught() -> None:
    actions = build_any_schedule("zb1", 2, 2)
    order = actions[1]
    i, j = order.index(Action(B, 0, 1)), order.index(Action(W, 0, 1))
    order[i], order[j] = order[j], order[i]
    with pytest.raises(ValueError, match="before its B"):
        simulate(actions)


# ---------------------------------------------------------------------------------------------------------------
# NCCL's order: the executor's program for every new schedule, step and evaluation
# ---------------------------------------------------------------------------------------------------------------

P2P_GRID = [(s, p, m) for p in (2, 4, 8) for s in ("zb1", "zbv", "dualpipev")
            for m in range(p if s == "zb1" else 2 * p, 3 * p + 1)]


def test_every_zero_bubble_schedule_posts_in_an_order_nccl_runs() -> None:
    for schedule, p, m in P2P_GRID:
        step = build_any_schedule(schedule, p, m)
        v_shape = schedule in ("zbv", "dualpipev")
        for actions in (step, forward_only(p, m, 2 if v_shape else 1, v_shape)):
            owners = chunk_owners(actions)
            outcome = replay(posting_order(actions, lambda message: (2, 8)))
            assert outcome.ok, (schedule, p, m, outcome)
            between = sum(a.kind in (SEND_F, SEND_B) and peer_of(a, p, owners) != r
                          for r, order in enumerate(actions) for a in order)
            assert outcome.pairs == between, (schedule, p, m)
            if v_shape:  # the bottom of the V hands over locally: two messages fewer per micro-batch
                assert between == sum(a.kind in (SEND_F, SEND_B) for o in actions for a in o) - (
                    2 * m if actions is step else m)


# ---------------------------------------------------------------------------------------------------------------
# One rank: the chunks hand over locally; the losses and gradients of the reference
# ---------------------------------------------------------------------------------------------------------------


def _one_rank_grads(schedule: str, m: int) -> tuple[float, dict[str, torch.Tensor]]:
    stage = partition_model(build_model(parity.CFG, seed=parity.SEED), 0, 1, schedule=schedule)
    runner = PipelineRunner(stage, Comm(), schedule, m, measure_memory=True)
    inputs, targets = parity.global_batch(0)
    batches = list(zip(inputs.chunk(m), targets.chunk(m)))
    count = sum((t != -100).sum() for _, t in batches).double()
    stats = runner.step(batches, loss_scale=1 / count)
    return stats.loss / count.item(), {n: p.grad for n, p in stage.named_parameters()}


def test_one_rank_zero_bubble_runs_match_the_reference_and_1f1b_bit_for_bit() -> None:
    reference = parity.reference_run()
    for schedule, fused, m in (("zb1", "1f1b", 4), ("zbv", "interleaved", 2), ("dualpipev", "interleaved", 2)):
        loss, grads = _one_rank_grads(schedule, m)
        parity.assert_losses_match([loss], reference["losses"][:1], schedule)
        parity.assert_grads_match(grads, reference["grads"], schedule)
        # The same chunks, each W in micro-batch order: the same sums in the same order as the fused backward.
        _, want = _one_rank_grads(fused, m)
        assert all(torch.equal(grads[n], want[n]) for n in want), f"{schedule} differs from {fused}"


@pytest.mark.parametrize("kwargs,match", [
    (dict(pp=2, microbatches=3, schedule="zbv"), "zbv needs microbatches >= 2\\*pp"),
    (dict(pp=2, microbatches=3, schedule="dualpipev"), "dualpipev needs microbatches >= 2\\*pp"),
    (dict(pp=4, microbatches=2, schedule="zb1"), "zb1 needs microbatches >= pp"),
    (dict(pp=2, microbatches=4, schedule="zb1", virtual_stages=2), "zb1 runs one chunk"),
    (dict(pp=2, microbatches=4, schedule="zbv", virtual_stages=3), "zbv places exactly two chunks"),
    (dict(pp=4, microbatches=8, schedule="zbv"), "fewer than the 8 pipeline chunks"),
])
def test_bad_zero_bubble_layouts_give_one_line_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match) as info:
        validate_pipeline(parity.CFG, **kwargs)
    assert "\n" not in str(info.value)


def test_a_zbv_checkpoint_is_another_layout_than_1f1b() -> None:
    """Same dims and virtual stages, but the V puts other layers on each rank: resuming must reshard, not restore
    each rank's own files."""
    import dataclasses
    from types import SimpleNamespace

    from minidist.comm.topology import ParallelDims
    from minidist.train.run_state import same_layout

    dims = ParallelDims(pp=2)

    def run(schedule: str) -> SimpleNamespace:
        cfg = SimpleNamespace(zero=0, virtual_stages=1, schedule=schedule)
        return SimpleNamespace(env=SimpleNamespace(world_size=2), topo=SimpleNamespace(dims=dims), cfg=cfg)

    def meta(schedule: str) -> dict:
        return {"world_size": 2, "parallel": dataclasses.asdict(dims),
                "config": {"zero": 0, "virtual_stages": 1, "schedule": schedule}}

    assert same_layout(meta("1f1b"), run("zb1"))  # zb1 places its chunks as 1F1B does
    assert not same_layout(meta("zbv"), run("1f1b"))
    assert not same_layout(meta("1f1b"), run("zbv"))
    assert same_layout(meta("zbv"), run("zbv"))


def test_moe_under_the_split_counts_each_routing_once() -> None:
    """MoE balancing losses flow through B and W; with recompute the graph is walked twice (B, then W), so the
    checkpoint replays the block twice: the routing statistics must still count each forward once, and the
    gradients equal 1F1B's bit for bit."""
    from minidist.model.moe.stats import moe_layers
    from minidist.train.blocks import apply_recompute

    cfg = parity.CFG.replace(moe={"n_experts": 4, "top_k": 2, "first_dense_layers": 2})
    inputs, targets = parity.global_batch(0)
    batches = list(zip(inputs.chunk(2), targets.chunk(2)))
    runs = {}
    for schedule in ("1f1b", "zb1", "zbv"):
        model = build_model(cfg, seed=parity.SEED)
        if schedule != "1f1b":  # against the fused backward with stored activations
            apply_recompute(model)
        stage = partition_model(model, 0, 1, schedule=schedule)
        stats = PipelineRunner(stage, Comm(), schedule, 2, with_aux=True).step(batches, loss_scale=1 / 256)
        runs[schedule] = (stats.aux_loss, [layer.step_sums.clone() for layer in moe_layers(stage)],
                          {n: p.grad for n, p in stage.named_parameters()})
    aux, sums, grads = runs["1f1b"]
    assert aux > 0
    for schedule in ("zb1", "zbv"):
        got_aux, got_sums, got_grads = runs[schedule]
        assert got_aux == aux, schedule
        assert all(torch.equal(a, b) for a, b in zip(got_sums, sums)), f"{schedule}: routing counted again"
        assert all(torch.equal(got_grads[n], grads[n]) for n in grads), schedule


def test_a_w_right_after_its_b_is_run_in_the_same_backward():
    """DualPipeV's full backwards (B, then its own W with nothing between) run as one backward in the runner
    (`fused_backwards`): every such pair is found, and no pair with other compute between them. The gradients are
    the split's, bit for bit (the parity tests above run dualpipev and zbv through this path)."""
    from minidist.parallel.pp.zero_bubble import build_any_schedule, fused_backwards

    for name in ("zb1", "zbv", "dualpipev"):
        for order in build_any_schedule(name, 4, 8):
            compute = [a for a in order if a.kind in ("F", "B", "W")]
            want = {(b.mb, b.chunk) for b, w in zip(compute, compute[1:])
                    if (b.kind, w.kind) == ("B", "W") and (b.mb, b.chunk) == (w.mb, w.chunk)}
            assert fused_backwards(order) == want
    assert fused_backwards(build_any_schedule("dualpipev", 4, 8)[0])  # its full backwards
    assert not fused_backwards(build_any_schedule("1f1b", 4, 8)[0])  # no W at all
