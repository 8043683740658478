"""CUDA's default path rehearsed on the CPU: the layouts of the device-sentinel matrix
(tests/test_device_sentinel.py; those with compiled graphs of their own, `SAME_GRAPHS`), plus the zero-bubble
schedules, context parallelism with documents, the three FP8 recipes, both recomputations and MoE on both expert
backends, with every block compiled (`--compile --compile-backend aot_eager`: dynamo and
AOTAutograd, the layers inductor sits on, then the same aten kernels as eager) and under the device sentinel (its
meta default device). Each compiled run logs what its eager run logs (losses and gradient norms, 1e-4 relative),
and compiles nothing after its second step (dynamo's counter of compiled frames, metrics.jsonl's `compiles`, on
every rank). One launch per world size (2 and 4 ranks) runs each layout eagerly, then compiled.

On main 7df2745 the compiled runs crashed: ZeRO-3 ("modified by an inplace operation": the block's hooks, which
gather its parameters with `param.data = ...`, were traced into the graph), ring attention (a recompile at ring
step 1 made its spans symbolic), zbv and dualpipev ("non-empty donated buffers" under zero-bubble's
`retain_graph=True`), and MoE ep2 (`torch._grouped_mm` chosen in fp32 on a CPU, whose traced rule wants bf16).

Each compiled run starts from an empty dynamo cache (`torch._dynamo.reset()`, as a new process would: kept from one
layout to the next, a later trace of cp all-gather's autograd function failed inside dynamo), and a frame past the
recompile limit is an error, not a silent fallback to eager (`fail_on_recompile_limit_hit`).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import trainer_parity
from device_sentinel import device_sentinel
from test_device_sentinel import LAYOUTS as SENTINEL_LAYOUTS
from test_device_sentinel import RESUME
from test_device_sentinel import config as sentinel_config

from minidist.comm.launch import run_ranks
from minidist.train import loop as train

STEPS = 3  # the third step must compile nothing
REL = 1e-4

# world size: {name: (model kind, the layout's settings)}: the sentinel's layouts, and these
EXTRA = {
    2: {
        "pp2 zb1": ("dense", dict(pp=2, schedule="zb1")),
        "pp2 zbv": ("dense", dict(pp=2, schedule="zbv", microbatches=4)),
        "pp2 dualpipev": ("dense", dict(pp=2, schedule="dualpipev", microbatches=4)),
        "doc-mask cp2 ulysses": ("docs", dict(cp=2, cp_impl="ulysses")),
        "fp8 tensorwise dp2": ("dense", dict(dp=2, fp8="tensorwise")),
        "fp8 rowwise dp2": ("dense", dict(dp=2, fp8="rowwise")),
        "fp8 blockwise dp2": ("dense", dict(dp=2, fp8="blockwise", fp8_block=16)),
        "recompute selective dp2": ("dense", dict(dp=2, recompute="selective")),
        "recompute full dp2 zero3": ("dense", dict(dp=2, zero=3, recompute="full")),
        "moe dp2 ep2 grouped_mm bf16": ("moe", dict(dp=2, ep=2, expert_backend="grouped_mm", dtype="bf16")),
    },
}
# Left out, for the suite's time (each compiled layout costs seconds of tracing on 2 cores): layouts whose compiled
# graphs another one here already traces (ZeRO 0 and 2 like ZeRO 1: data parallelism acts after the backward; AFAB
# and interleaved like 1F1B: the same blocks, in other chunks and another order), and the sentinel's resume (a
# checkpoint's reload, no graph of its own). The 4-rank compositions run in a second launch.
SAME_GRAPHS = ("dp2 zero0", "dp2 zero2", "pp2 afab", "pp2 interleaved")
LAYOUTS = {2: {**{n: v for n, v in SENTINEL_LAYOUTS[2].items() if n not in SAME_GRAPHS}, **EXTRA[2]},
           4: {n: v for n, v in SENTINEL_LAYOUTS[4].items() if n != RESUME}}


def config(out: str, kind: str, **changes) -> train.TrainConfig:
    """The sentinel's 2-step runs made 3 steps, without the evaluation (a third, no-grad graph) or replica check."""
    return sentinel_config(out, kind, **{"steps": STEPS, "val_fraction": 0.0, "check_every": 0, **changes})


def _run(root: str, name: str, kind: str, settings: dict, compiled: bool) -> dict:
    out = str(Path(root) / f"{name.replace(' ', '_')}{'_compiled' if compiled else ''}")
    extra = dict(compile=True, compile_backend="aot_eager") if compiled else {}
    torch._dynamo.reset()
    summary = train.train(config(out, kind, **settings, **extra))
    dist.barrier()  # rank 0 has written metrics.jsonl
    records = trainer_parity.records(out)
    return {"losses": summary["losses"], "grad_norms": [r["grad_norm"] for r in records],
            "compiles": summary["compiles"]}


def _rank_layouts(root: str, world: int) -> dict:
    """The rank function: each layout eagerly, then compiled, all under the sentinel."""
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    results = {}
    with device_sentinel():
        for name, (kind, settings) in LAYOUTS[world].items():
            results[name] = {"eager": _run(root, name, kind, settings, False),
                             "compiled": _run(root, name, kind, settings, True)}
    return results


@functools.lru_cache(maxsize=2)
def _results(root: str, world: int) -> list[dict]:
    return run_ranks(_rank_layouts, world, root, world, timeout=900, threads_per_rank=1,
                     case=f"compiled layouts, {world} ranks")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("compiled"))


@pytest.mark.parametrize("world, name", [(w, n) for w, layouts in LAYOUTS.items() for n in layouts])
def test_compiled_layout_logs_its_eager_run_and_stops_compiling(world, name, root) -> None:
    for rank, result in enumerate(_results(root, world)):
        eager, compiled = result[name]["eager"], result[name]["compiled"]
        for key in ("losses", "grad_norms"):
            assert compiled[key] == pytest.approx(eager[key], rel=REL), \
                f"{name}, rank {rank}: compiled {key} {compiled[key]} != eager {eager[key]}"
        assert eager["compiles"] == [None] * STEPS  # an eager run logs no compiles
        assert compiled["compiles"][2:] == [0] * (STEPS - 2), \
            f"{name}, rank {rank}: frames compiled per step {compiled['compiles']} (recompiles after step 2)"
