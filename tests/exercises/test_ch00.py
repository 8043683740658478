"""Grade chapter 00's exercises: ring_reduce_scatter and ring_all_reduce built from point-to-point messages.

`pytest tests/exercises -k ch00` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
Each function runs on 2, 3 and 4 ranks, on the whole world and on a sub-group (ranks 0, 2, ... and 1, 3, ...), for
sizes that do not divide by the group size. The oracle is torch.distributed.all_reduce; integer-valued inputs make
every sum exact, so results must be equal, not merely close.
"""

import importlib
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from minidist.comm.launch import run_ranks

SHAPES = [(1,), (2,), (7,), (13,), (1001,), (5, 3)]
FUNCTIONS = ["ring_all_reduce", "ring_reduce_scatter"]
# Calling any of these instead of sending messages defeats the exercise.
FORBIDDEN = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
             "reduce_scatter_tensor", "reduce_scatter_single", "reduce", "broadcast", "all_to_all",
             "all_to_all_single", "gather", "scatter")


def _input(shape: tuple[int, ...], rank: int) -> torch.Tensor:
    dtype = torch.float64 if len(shape) > 1 else torch.float32
    g = torch.Generator().manual_seed(1000 * rank + sum(shape))
    return torch.randint(-50, 50, shape, generator=g).to(dtype)


@contextmanager
def _point_to_point_only(sent: list[int]):
    """Count the bytes this rank sends (into sent[0]) and make every collective raise while inside."""
    saved = {name: getattr(dist, name) for name in FORBIDDEN if hasattr(dist, name)}
    # dist.send calls isend, and batch_isend_irecv calls P2POp.op (isend): counting isend counts every send once.
    saved_p2p = {"isend": c10d.isend}

    def forbidden(name):
        def call(*args, **kwargs):
            raise AssertionError(f"dist.{name} is not allowed here: build the collective from isend/irecv")
        return call

    def counting(original):
        def call(tensor, *args, **kwargs):
            sent[0] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)
        return call

    try:
        for name in saved:
            setattr(dist, name, forbidden(name))
        for name, original in saved_p2p.items():
            # Patch both names, so that dist.P2POp(dist.isend, ...) still passes torch's own check.
            wrapped = counting(original)
            setattr(dist, name, wrapped)
            setattr(c10d, name, wrapped)
        yield
    finally:
        for name, original in saved.items():
            setattr(dist, name, original)
        for name, original in saved_p2p.items():
            setattr(dist, name, original)
            setattr(c10d, name, original)


def grade_worker(impl: str) -> dict[str, list[dict] | None]:
    """On every rank: run the chosen implementation's functions on every case; None for one not implemented."""
    rank, world = dist.get_rank(), dist.get_world_size()
    halves = [list(range(0, world, 2)), list(range(1, world, 2))]
    groups = [dist.new_group(ranks) for ranks in halves]  # every rank creates both, in the same order
    mine = 0 if rank % 2 == 0 else 1
    layouts = [("world", None, list(range(world))), ("sub", groups[mine], halves[mine])]

    graded = {}
    for fn_name in FUNCTIONS:
        cases = []
        for layout, group, members in layouts:
            p, me = len(members), members.index(rank)
            for shape in SHAPES:
                x = _input(shape, rank)
                expected = x.clone()
                dist.all_reduce(expected, group=group)
                if fn_name == "ring_reduce_scatter":
                    expected = torch.tensor_split(expected, p, dim=0)[me]
                cases.append(dict(layout=layout, group=group, members=members, shape=shape, x=x, expected=expected))

        results = []
        try:
            for case in cases:
                sent = [0]
                with _point_to_point_only(sent):
                    fn = getattr(importlib.import_module(f"{impl}.ch00_collectives"), fn_name)
                    arg = case["x"].clone()
                    got = fn(arg, case["group"])
                results.append(dict(layout=case["layout"], members=case["members"], shape=case["shape"],
                                    element_size=case["x"].element_size(), got=got, expected=case["expected"],
                                    after=arg, sent=sent[0]))
        except NotImplementedError:
            # A stub raises on every rank before sending anything, so the ranks stay in step for the next function.
            results = None
        graded[fn_name] = results
    return graded


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda p: f"world{p}")
def graded(request: pytest.FixtureRequest, impl: str) -> tuple[int, list[dict]]:
    """One launch per world size grades every function of the chapter."""
    world = request.param
    halves = [list(range(0, world, 2)), list(range(1, world, 2))]
    case = (f"world {world}: {impl}.ch00_collectives {', '.join(FUNCTIONS)} on the world group and on the "
            f"sub-groups {halves[0]} and {halves[1]}, shapes {', '.join(map(str, SHAPES))}")
    return world, run_ranks(grade_worker, world, impl, timeout=60, case=case)


@pytest.mark.parametrize("fn_name", FUNCTIONS)
def test_ch00(graded: tuple[int, list[dict]], impl: str, fn_name: str) -> None:
    world_size, per_rank_all = graded
    per_rank = [graded_by_fn[fn_name] for graded_by_fn in per_rank_all]
    if any(results is None for results in per_rank):
        pytest.fail(f"{impl}.ch00_collectives.{fn_name} is not implemented yet", pytrace=False)

    for rank, results in enumerate(per_rank):
        for r in results:
            where = f"{fn_name} on rank {rank}, {r['layout']} group {r['members']}, shape {r['shape']}"
            assert r["got"].shape == r["expected"].shape, f"{where}: shape {tuple(r['got'].shape)}, " \
                                                         f"expected {tuple(r['expected'].shape)}"
            assert torch.equal(r["got"], r["expected"]), f"{where}: wrong values"
            if fn_name == "ring_all_reduce":
                assert torch.equal(r["after"], r["expected"]), f"{where}: the input tensor was not reduced in place"

    # Bandwidth: in a ring every chunk crosses p-1 links per phase, so the group's ranks send (p-1)·M bytes per
    # phase in total, and no rank sends more than p-1 of the largest chunks per phase.
    phases = 2 if fn_name == "ring_all_reduce" else 1
    for i, first in enumerate(per_rank[0]):
        for members in {tuple(per_rank[r][i]["members"]) for r in range(world_size)}:
            sent = [per_rank[r][i]["sent"] for r in members]
            p, shape, esize = len(members), first["shape"], first["element_size"]
            numel = int(torch.tensor(shape).prod())
            rows = numel if fn_name == "ring_all_reduce" else shape[0]  # all-reduce chunks the flattened tensor
            unit = numel * esize // rows
            where = f"{fn_name}, group {list(members)}, shape {shape}: bytes sent per rank {sent}"
            assert sum(sent) == phases * (p - 1) * numel * esize, f"{where}; a ring sends {phases}(p-1)·M in total"
            assert max(sent) <= phases * (p - 1) * _ceil_div(rows, p) * unit, \
                f"{where}; a ring rank sends at most {phases}(p-1) chunks"
