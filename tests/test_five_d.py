"""The 5D parity matrix: dp, tp, pp, cp and ep composed, with ZeRO 1-3, MoE and dense models, the three schedules
and tied embeddings across pipeline stages, each layout logging the one-process run (losses, gradient norms,
validation losses; MoE: the balancing loss too).

Not all products: a covering set. `MATRIX` is chosen so that every pair of the five dimensions is > 1 together in at
least one layout, and every ZeRO stage 1-3, both model kinds and every schedule appear (on 8 ranks at most three of
dp/tp/pp/cp exceed 1; ep is carved out of dp·cp), and a tied embedding meets pp. `test_the_matrix_covers_every_pair`
computes that coverage from the table itself, and that no layout could be dropped without losing some of it.
Two launches: 8 ranks for the layouts with three dimensions, 4 ranks for the others.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field

import pytest
import torch
import trainer_parity

from minidist.comm.launch import run_ranks
from minidist.train.config import TrainConfig
from minidist.train.preflight import resolve_layout

DIMS = ("dp", "tp", "pp", "cp", "ep")
ZERO_STAGES, SCHEDULES, KINDS = (1, 2, 3), ("afab", "1f1b", "interleaved"), ("dense", "moe")
DENSE = {"n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "max_seq_len": 64}
# dropless (context parallelism refuses a capacity factor), the aux-free bias on: its counts are summed over replicas
MOE = dict(DENSE, moe={"n_experts": 4, "top_k": 2, "bias_update_speed": 0.05})


@dataclass(frozen=True)
class TrainerCase:
    """One trainer run of the matrix: a model kind and the TrainConfig settings of its layout."""

    kind: str  # "dense" or "moe"
    settings: dict = field(default_factory=dict)  # TrainConfig fields: dims, zero, schedule, sp, cp_impl, ...
    tied: bool = False  # tie_embeddings: the first and last stage each hold a copy

    @property
    def world(self) -> int:
        return math.prod(self.settings.get(d, 1) for d in ("dp", "tp", "pp", "cp"))

    @property
    def name(self) -> str:
        dims = " ".join(f"{d}{self.settings[d]}" for d in DIMS if self.settings.get(d, 1) > 1)
        extra = " sp" if self.settings.get("sp") else ""
        kind = f"{self.kind} tied" if self.tied else self.kind
        return f"{dims}{extra} zero{self.settings.get('zero', 0)} {self.settings.get('schedule', '-')} {kind}"

    def on(self) -> set[str]:
        return {d for d in DIMS if self.settings.get(d, 1) > 1}


MATRIX = [
    #      dims (> 1)                 ZeRO    schedule                          model
    TrainerCase("moe", dict(dp=2, tp=2, pp=2, ep=2, zero=1, schedule="1f1b")),
    TrainerCase("dense", dict(cp=2, tp=2, pp=2, sp=True, zero=3, schedule="interleaved", virtual_stages=2)),
    TrainerCase("moe", dict(dp=2, cp=2, ep=4, zero=2, cp_impl="allgather")),
    TrainerCase("moe", dict(dp=2, pp=2, ep=2, zero=3, schedule="afab"), tied=True),
]


def coverage(layouts: list[TrainerCase]) -> set[tuple]:
    """What a set of layouts exercises: pairs of dimensions > 1 together, ZeRO stages, schedules, model kinds."""
    covered: set[tuple] = set()
    for layout in layouts:
        covered |= {("pair", *p) for p in itertools.combinations(sorted(layout.on()), 2)}
        covered.add(("zero", layout.settings.get("zero", 0)))
        covered.add(("kind", layout.kind))
        if layout.settings.get("pp", 1) > 1:
            covered.add(("schedule", layout.settings.get("schedule", "1f1b")))
            if layout.tied:
                covered.add(("tied across stages",))
    return covered


def config(out: str, kind: str, tied: bool = False, **changes) -> TrainConfig:
    """2 steps of batch 8 x 32 with clipping active; validation after each."""
    model = dict(MOE if kind == "moe" else DENSE, tie_embeddings=tied)
    settings = dict(model="tiny", model_overrides=model, max_bytes=100_000,
                    batch_size=8, seq_len=32, microbatches=2, steps=2, warmup_steps=1, grad_clip=1.0, eval_every=1,
                    eval_batches=1, log_every=100, ckpt_every=0, out=out, seed=0, peak_flops=1e12, plot=False)
    return TrainConfig(**{**settings, **changes})


def test_the_matrix_covers_every_pair() -> None:
    want = ({("pair", *sorted(p)) for p in itertools.combinations(DIMS, 2)} | {("zero", z) for z in ZERO_STAGES}
            | {("schedule", s) for s in SCHEDULES} | {("kind", k) for k in KINDS} | {("tied across stages",)})
    got = coverage(MATRIX)
    assert want <= got, f"not covered: {sorted(want - got)}"
    for layout in MATRIX:
        assert coverage([m for m in MATRIX if m is not layout]) & want != want, f"{layout.name} adds nothing"
        assert layout.world in (4, 8)
        assert len(layout.on() - {"ep"}) <= 3
        assert (layout.kind == "moe") >= (layout.settings.get("ep", 1) > 1)  # ep needs experts
        resolve_layout(config("unused", layout.kind, layout.tied, **layout.settings), layout.world)  # valid
    assert len(MATRIX) < len(list(itertools.product(ZERO_STAGES, SCHEDULES, KINDS)))  # far below all products


def _rank_runs(root: str, world: int) -> dict:
    layouts = {m.name: dict(m.settings, kind=m.kind, tied=m.tied) for m in MATRIX if m.world == world}
    return trainer_parity.train_layouts(root, layouts, config)


@functools.lru_cache(maxsize=2)
def _results(root: str, world: int) -> list[dict]:
    return run_ranks(_rank_runs, world, root, world, timeout=900, threads_per_rank=1, case=f"5D matrix, {world} ranks")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("five_d"))


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[tuple[str, bool], list[dict]]:
    """The one-process run of each model the matrix trains (kind, tied)."""
    models = sorted({(m.kind, m.tied) for m in MATRIX})
    return {(kind, tied): trainer_parity.single_process_records(str(tmp_path_factory.mktemp(kind)),
                                                                functools.partial(config, kind=kind, tied=tied))
            for kind, tied in models}


@pytest.mark.parametrize("layout", MATRIX, ids=lambda m: m.name.replace(" ", "-"))
def test_layout_matches_one_process(layout, root, references) -> None:
    results = _results(root, layout.world)
    records, reference = results[0][layout.name]["records"], references[(layout.kind, layout.tied)]
    trainer_parity.assert_logs_match(layout.name, records, reference)
    if layout.kind == "moe":
        got, want = [r["aux_loss"] for r in records], [r["aux_loss"] for r in reference]
        assert torch.allclose(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-8), \
            f"{layout.name}: aux_loss {got} != single process {want}"
    for r in results:  # every rank returns the same (global) losses
        assert r[layout.name]["losses"] == results[0][layout.name]["losses"]
    assert reference[0]["grad_norm"] > 1.0  # clipping was active: a wrong norm would change the second loss
