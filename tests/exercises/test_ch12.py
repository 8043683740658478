"""Grade chapter 12's exercises: the rank grid of five dimensions and a memory estimate per rank.

`pytest tests/exercises -k ch12` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
Oracles: `minidist.comm.topology` (coordinates, group_ranks), `minidist.plan.rank_memory.model_state_bytes` (on a small
MoE model's real parameter counts) and the 1F1B schedule `minidist.parallel.pp.schedules` builds.
"""

import random

import pytest
from grading import load

from minidist.comm.topology import ParallelDims, coordinates, group_ranks
from minidist.model import get_preset
from minidist.parallel import Layout
from minidist.parallel.pp.schedules import build_schedule
from minidist.plan.rank_memory import BF16_MIXED, FP32, model_state_bytes, rank_params

MODULE = "ch12_five_dimensions"
CHAPTER_GRID = dict(dp=2, tp=2, pp=2, cp=2, ep=2)
GROUPS = ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp")


def _grids():
    yield CHAPTER_GRID
    rng = random.Random(12)
    for _ in range(6):
        dp, cp = rng.choice([1, 2, 3, 4]), rng.choice([1, 2])
        ep = rng.choice([e for e in (1, 2, 3, 4) if (dp * cp) % e == 0])
        yield dict(dp=dp, tp=rng.choice([1, 2, 4]), pp=rng.choice([1, 2, 3]), cp=cp, ep=ep)


def test_ch12_rank_coordinates(impl: str) -> None:
    rank_coordinates = load(impl, MODULE, "rank_coordinates")
    got = rank_coordinates(13, **CHAPTER_GRID)
    assert got == {"pp": 1, "dp": 1, "cp": 0, "tp": 1, "dp_cp": 2, "ep": 0, "edp": 1}, (
        f"rank 13 of the chapter's grid: got {got}; tp varies fastest, then cp, dp, pp")
    for grid in _grids():
        dims = ParallelDims(**grid)
        for rank in range(dims.world_size):
            want = {k: coordinates(dims, rank)[k] for k in ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp")}
            got = rank_coordinates(rank, **grid)
            assert got == want, f"{grid}, rank {rank}: got {got}, want {want}"


def test_ch12_group_members(impl: str) -> None:
    group_members = load(impl, MODULE, "group_members")
    example = {"tp": [12, 13], "dp_cp": [9, 11, 13, 15], "ep": [13, 15], "edp": [9, 13]}
    for name, want in example.items():
        got = group_members(13, name, **CHAPTER_GRID)
        assert list(got) == want, f"rank 13's {name} group on the chapter's grid: got {got}, want {want}"
    for grid in _grids():
        dims = ParallelDims(**grid)
        for name in GROUPS:
            for group in group_ranks(dims, name):
                for rank in group:
                    got = list(group_members(rank, name, **grid))
                    hint = " — did a dp or cp group require equal dp_cp?" if len(got) == 1 < len(group) else ""
                    assert got == group, f"{grid}, rank {rank}, group {name}: got {got}, want {group}{hint}"


@pytest.mark.parametrize("precision", [BF16_MIXED, FP32], ids=["bf16-mixed", "fp32"])
def test_ch12_model_state_bytes(impl: str, precision) -> None:
    model_state = load(impl, MODULE, "model_state_bytes")
    got = model_state(1000, 4000, 4, 2, 1)
    assert got["optimizer"] == 27000 and got["params"] == 10000, f"the docstring's example: got {got}"
    cfg = get_preset("tiny", moe=dict(n_experts=8, top_k=2, first_dense_layers=1))
    for dp, cp, ep, tp, zero in [(4, 1, 2, 1, 1), (2, 2, 4, 2, 2), (8, 1, 8, 1, 3), (2, 1, 1, 2, 0)]:
        layout = Layout.of(dp=dp, cp=cp, ep=ep, tp=tp, zero=zero)
        counts = rank_params(cfg, layout)
        want = model_state_bytes(cfg, layout, precision)
        got = model_state(counts["dense"], counts["experts"], dp * cp, ep, zero, precision.param, precision.grad,
                          precision.optimizer)
        for part in want:
            hint = ""
            if ep > 1 and zero >= 1 and got[part] < want[part]:
                hint = " — experts are replicated over dp_cp / ep ranks, not dp_cp"
            assert got[part] == pytest.approx(want[part]), f"{layout}: {part} got {got[part]}, want {want[part]}{hint}"


def test_ch12_in_flight_1f1b(impl: str) -> None:
    in_flight = load(impl, MODULE, "in_flight_1f1b")
    for pp, m in [(2, 4), (4, 8), (4, 2), (3, 5), (1, 3)]:
        schedule = build_schedule("1f1b", pp, m)
        for stage in range(pp):
            live = peak = 0
            for action in schedule[stage]:
                if action.kind in ("F", "B"):
                    live += 1 if action.kind == "F" else -1
                    peak = max(peak, live)
            got = in_flight(pp, m, stage)
            assert got == peak, f"pp={pp}, m={m}, stage {stage}: got {got}, the schedule holds {peak}"
