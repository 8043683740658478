"""Expert parallelism (chapter 11) and layout-independent MoE balancing: every layout reproduces the single-device
run (losses, balancing losses, gradient norms, the logged balance figures, first-step gradients, router biases);
the dispatch bytes equal the formula from the actual counts; bad layouts fail in one line before any group.

One launch per world size runs every layout of that size (tests/ep_cases.py); the comparisons happen here.
"""

from __future__ import annotations

import ep_cases
import parity
import pytest
import torch

from minidist.model import get_preset
from minidist.parallel.ep.expert import validate_expert_parallel
from minidist.train.config import ConfigError, TrainConfig
from minidist.train.preflight import resolve_layout

STAT_RTOL = 1e-5


def _close(got: float, want: float, rtol: float = parity.LOSS_RTOL, atol: float = parity.LOSS_ATOL) -> bool:
    return abs(got - want) <= atol + rtol * abs(want)


def _layouts() -> list[tuple[int, str]]:
    return [(world, name) for world, layouts in ep_cases.LAYOUTS.items() for name in layouts]


@pytest.mark.parametrize("world, name", _layouts(), ids=lambda v: str(v).replace(" ", "_"))
def test_layout_matches_one_device(world: int, name: str) -> None:
    router = ep_cases.LAYOUTS[world][name][0]
    want = ep_cases.reference(router)
    ranks = [per_rank["layouts"][list(ep_cases.LAYOUTS[world]).index(name)] for per_rank in ep_cases.results(world)]
    for rank, got in enumerate(ranks):
        label = f"{name}, rank {rank}"
        parity.assert_losses_match(got["losses"], want["losses"], label)
        assert all(_close(g, w) for g, w in zip(got["aux"], want["aux"])), (label, got["aux"], want["aux"])
        parity.assert_norms_match(got["norms"], want["norms"], label)
        for step, (g, w) in enumerate(zip(got["stats"], want["stats"])):
            assert g.keys() == w.keys(), (label, g, w)
            bad = {k: (g[k], w[k]) for k in w if not _close(g[k], w[k], STAT_RTOL, 1e-7)}
            assert not bad, f"{label}, step {step}: logged balance figures differ from one device: {bad}"
        for layer, bias in got["biases"].items():
            torch.testing.assert_close(bias, want["biases"][layer], rtol=0, atol=1e-6, msg=label)
        if got["grads"] is not None:
            subset = {n: want["grads"][n] for n in got["grads"]}
            parity.assert_grads_match(got["grads"], subset, label)


def test_the_cases_drop_and_balance() -> None:
    """The capacity cases really drop slots (so parity covers dropping) and the bias case really moves biases."""
    for router in ("softmax_cf", "sigmoid_bias_cf"):
        assert min(s["moe_drop_rate"] for s in ep_cases.reference(router)["stats"]) > 0.01, router
    assert ep_cases.reference("softmax")["stats"][0]["moe_drop_rate"] == 0.0
    assert ep_cases.reference("sigmoid_bias_cf")["biases"].abs().min() > 0


def test_microbatches_change_nothing_on_one_device() -> None:
    """Capacity and the balance loss per sequence: 2 micro-batches log what one batch logs (per forward call they
    dropped other slots and averaged f·P over fewer tokens)."""
    one, two = ep_cases.reference("softmax_cf", 1), ep_cases.reference("softmax_cf", 2)
    parity.assert_losses_match(two["losses"], one["losses"], "2 micro-batches")
    for g, w in zip(two["stats"], one["stats"]):
        assert all(_close(g[k], w[k], STAT_RTOL, 1e-7) for k in w), (g, w)
    parity.assert_grads_match(two["grads"], one["grads"], "2 micro-batches")


@pytest.mark.parametrize("world", sorted(ep_cases.LAYOUTS))
def test_dispatch_bytes_equal_the_formula(world: int) -> None:
    checked = 0
    for per_rank in ep_cases.results(world):
        for got in per_rank["layouts"]:
            if "ledger" in got:
                assert got["ledger"]["measured"] == got["ledger"]["formula"] > 0, (got["name"], got["ledger"])
                checked += 1
    assert checked >= world


def test_moe_under_tensor_parallel_sends_what_the_formula_says() -> None:
    """MoE layers are whole on every tp rank; under sequence parallelism each gathers its input and the gradient
    of its output (one all-gather each way), and nothing else: the tp ledger of a step equals expected_tp_traffic."""
    checked = 0
    for per_rank in ep_cases.results(4):
        for got in per_rank["layouts"]:
            if "tp_expected" in got:
                assert got["tp_traffic"] == got["tp_expected"], got["name"]
                checked += 1
    assert checked == 4


def test_a_rank_that_receives_no_rows_still_joins_forward_and_backward() -> None:
    ranks = [r["starved"] for r in ep_cases.results(2)]
    one = ranks[0]["one"]  # the same single-device layer on both ranks
    ep = [r["ep"] for r in ranks]
    assert ep[1]["experts"]["w1"] is None or ep[1]["experts"]["w1"].abs().sum() == 0  # rank 1 computed nothing
    torch.testing.assert_close(torch.cat([r["y"] for r in ep]), one["y"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(torch.cat([r["x_grad"] for r in ep]), one["x_grad"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(sum(r["router"] for r in ep), one["router"], rtol=1e-10, atol=1e-12)
    for name, grad in ep[0]["experts"].items():  # rank 0 holds experts 0-1: every slot's gradient is there
        torch.testing.assert_close(grad, one["experts"][name][:2], rtol=1e-10, atol=1e-12)


def test_own_rows_stay_home_and_the_dispatch_overlaps_them() -> None:
    """Rank 0 routes every slot to its own experts: its dispatch sends no row (not even to itself, through the
    collective), and the dispatch is started asynchronously (the own rows run while it travels). Rank 1 sends all
    its rows. Calls per rank: counts, dispatch, combine forward; combine and dispatch backward."""
    calls = [r["starved"]["calls"] for r in ep_cases.results(2)]
    assert [len(c) for c in calls] == [5, 5], calls
    for rank, rank_calls in enumerate(calls):
        counts, dispatch, combine = rank_calls[:3]
        assert dispatch["async_op"] and not combine["async_op"], rank_calls
        assert dispatch["in_splits"][rank] == 0 and combine["in_splits"][rank] == 0, rank_calls
    assert calls[0][1]["rows"] == 0 and calls[1][1]["rows"] == 16, calls  # 2 sequences x 2 experts x capacity 4


def _cfg(**changes) -> TrainConfig:
    settings = dict(model="tiny", model_overrides=dict(ep_cases.BASE, moe=dict(n_experts=4)), batch_size=8,
                    seq_len=32)
    return TrainConfig(**{**settings, **changes})


@pytest.mark.parametrize("changes, world, words", [
    (dict(dp=4, ep=3), 4, "ep=3 does not divide dp*cp=4"),
    (dict(dp=2, ep=4), 2, "ep=4 does not divide dp*cp=2"),
    (dict(dp=4, ep=4, model_overrides=dict(ep_cases.BASE, moe=dict(n_experts=6, top_k=2))), 4,
     "ep=4 does not divide n_experts=6"),
    (dict(dp=2, ep=2, model_overrides=dict(ep_cases.BASE)), 2, "this model is dense"),
])
def test_bad_layouts_fail_in_one_line_before_any_group(changes: dict, world: int, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_layout(_cfg(**changes), world)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_validate_expert_parallel_accepts_what_fits() -> None:
    cfg = get_preset("tiny", **ep_cases.BASE, moe=dict(n_experts=8))
    for ep, dp_cp in ((1, 1), (2, 2), (4, 8), (8, 8)):
        validate_expert_parallel(cfg, ep, dp_cp)
    with pytest.raises(ValueError, match="pick ep from"):
        validate_expert_parallel(cfg, 3, 6)
