"""The rank grid: validation, coordinates, and process groups equal to torch's DeviceMesh for the same shape."""

import itertools
import types

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from minidist.comm import topology as topology_module
from minidist.comm.communicator import Comm
from minidist.comm.launch import run_ranks
from minidist.comm.topology import (
    GROUP_NAMES,
    ParallelDims,
    Topology,
    coordinates,
    group_ranks,
    planned_groups,
    rank_grid,
)

# (pp, dp, cp, tp, ep) layouts; each must use all ranks.
# Each launch checks a few layouts against DeviceMesh (each layout costs ~1 s of group creation on 8 ranks); the
# process-free tests below check more.
SHAPES_8 = [(2, 2, 1, 2, 1), (2, 2, 2, 1, 2), (1, 2, 2, 2, 4), (1, 1, 2, 4, 1)]
SHAPES_4 = [(1, 2, 1, 2, 2), (2, 1, 2, 1, 2), (1, 4, 1, 1, 2)]
MORE_SHAPES = [(1, 8, 1, 1, 4), (1, 1, 1, 8, 1), (8, 1, 1, 1, 1), (1, 2, 4, 1, 2), (1, 1, 4, 1, 1), (3, 2, 1, 1, 2),
               (1, 3, 1, 2, 3)]


def _dims(shape: tuple[int, ...]) -> ParallelDims:
    pp, dp, cp, tp, ep = shape
    return ParallelDims(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)


# --- validation -------------------------------------------------------------------------------------------------


def _one_line_error(fn) -> str:
    with pytest.raises(ValueError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_dp_that_does_not_divide_the_world_says_what_fits() -> None:
    message = _one_line_error(lambda: ParallelDims(dp=3).validate(8))
    assert "dp=3 does not divide world_size=8" in message and "dp=8 would fit" in message


def test_too_few_ranks_says_what_fits() -> None:
    message = _one_line_error(lambda: ParallelDims(dp=2, tp=2).validate(8))
    assert "dp=4 would fit" in message


def test_tp_that_does_not_divide_says_so() -> None:
    message = _one_line_error(lambda: ParallelDims(tp=3, dp=2).validate(8))
    assert "tp=3 does not divide world_size=8" in message and "tp*pp*cp=3 does not divide 8" in message


@pytest.mark.parametrize("field", ["dp", "tp", "pp", "cp", "ep"])
@pytest.mark.parametrize("value", [0, -2])
def test_zero_and_negative_degrees_are_refused(field: str, value: int) -> None:
    message = _one_line_error(lambda: ParallelDims(**{field: value}))
    assert f"{field} must be a positive integer, got {value}" in message


def test_ep_must_divide_dp_times_cp() -> None:
    message = _one_line_error(lambda: ParallelDims(dp=2, cp=2, ep=3))
    assert "ep=3 does not divide dp*cp=4" in message and "[1, 2, 4]" in message


def test_validation_happens_before_any_group() -> None:
    # No torch.distributed here: a bad layout must fail on its own, not inside new_group.
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="dp=3"):
        Topology(ParallelDims(dp=3), 0, 8)
    with pytest.raises(ValueError, match="needs torch.distributed initialised with 8 ranks"):
        Topology(ParallelDims(dp=8), 0, 8)


# --- coordinates and groups, without processes --------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES_8 + SHAPES_4 + MORE_SHAPES)
def test_coordinates_invert_the_rank_formula(shape) -> None:
    dims = _dims(shape)
    pp, dp, cp, tp, ep = shape
    grid = rank_grid(dims)
    for p_, d_, c_, t_ in itertools.product(range(pp), range(dp), range(cp), range(tp)):
        rank = ((p_ * dp + d_) * cp + c_) * tp + t_  # tp fastest, then cp, dp, pp
        assert int(grid[p_, d_, c_, t_]) == rank
        c = coordinates(dims, rank)
        assert (c["pp"], c["dp"], c["cp"], c["tp"]) == (p_, d_, c_, t_)
        assert c["dp_cp"] == d_ * cp + c_ and c["ep"] == (d_ * cp + c_) % ep and c["edp"] == (d_ * cp + c_) // ep


@pytest.mark.parametrize("shape", SHAPES_8 + SHAPES_4 + MORE_SHAPES)
def test_groups_partition_the_world_along_their_dimension(shape) -> None:
    dims = _dims(shape)
    varying = {"pp": {"pp", "tied"}, "dp": {"dp", "dp_cp", "ep", "edp"}, "cp": {"cp", "dp_cp", "ep", "edp"},
               "tp": {"tp"}, "dp_cp": {"dp", "cp", "dp_cp", "ep", "edp"}, "ep": {"dp", "cp", "dp_cp", "ep"},
               "edp": {"dp", "cp", "dp_cp", "edp"}, "tied": {"pp", "tied"}, "world": set(GROUP_NAMES)}
    for name in GROUP_NAMES:
        groups = group_ranks(dims, name)
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
        for g in groups:
            coords = [coordinates(dims, r) for r in g]
            # Members agree on every coordinate the group does not span, and are ordered by their index in it.
            for key in set(GROUP_NAMES) - varying[name] - {"world"}:
                assert len({c[key] for c in coords}) == 1, (name, key, g)
            assert [c[name] for c in coords] == list(range(len(g)))


def test_a_2x2x2_grid_by_hand() -> None:
    dims = ParallelDims(dp=2, tp=2, pp=2)
    assert group_ranks(dims, "tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_ranks(dims, "dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_ranks(dims, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_ranks(dims, "tied") == [[0, 4], [1, 5], [2, 6], [3, 7]]  # pp 2: the two ends are the pipeline
    assert group_ranks(ParallelDims(pp=4), "tied") == [[0, 3], [1], [2]]  # the ends paired, the middle alone


def test_world_size_one_has_no_groups_and_identity_comms() -> None:
    import torch

    topology = Topology(ParallelDims(), 0, 1)
    for name in GROUP_NAMES:
        assert topology.group(name) is None and topology.size(name) == 1 and topology.ranks(name) == [0]
    assert topology.pp_prev_rank is None and topology.pp_next_rank is None
    comm = topology.comm("dp")
    x = torch.arange(5.0)
    assert comm.all_reduce(x.clone()).equal(x) and comm.all_gather(x).equal(x)
    assert comm.ledger.bytes() == 0 and comm.ledger.calls() == 2


# --- which process groups a Topology creates ------------------------------------------------------------------


def _created_groups(monkeypatch, dims: ParallelDims, rank: int = 0) -> tuple[list[list[int]], Topology]:
    """The rank sets `Topology` passes to `dist.new_group` on `rank`, in a world faked for it (no processes)."""
    made: list[list[int]] = []
    world = object()

    def new_group(ranks, timeout=None):
        made.append(list(ranks))
        return ("group", tuple(ranks))

    fake = types.SimpleNamespace(is_initialized=lambda: True, get_world_size=lambda group=None: dims.world_size,
                                 new_group=new_group, group=types.SimpleNamespace(WORLD=world))
    monkeypatch.setattr(topology_module, "dist", fake)
    return made, Topology(dims, rank, dims.world_size)


@pytest.mark.parametrize(("shape", "groups"), [
    ((1, 8, 1, 1, 1), 0),  # dp8: every group is the world (dp, dp_cp, edp) or one rank (tp, pp, cp, ep, tied)
    ((1, 2, 1, 2, 1), 4),  # dp2 tp2: two tp pairs, two dp pairs (dp_cp and edp are the dp pairs)
    ((4, 4, 1, 8, 1), 112),  # 128 GPUs, pp4 dp4 tp8: 16 tp groups of 8, 32 dp of 4, 32 pp of 4, 32 tied ends pairs
    ((2, 2, 2, 1, 2), 14),  # pp2 dp2 cp2 ep2: pp 4 (= tied), dp 4, cp 4, dp_cp 2 (ep = cp, edp = dp)
])
def test_only_distinct_groups_of_two_or_more_ranks_are_created(monkeypatch, shape, groups) -> None:
    """Before: every group of every dimension (44 in a dp8 job, 497 for pp4 dp4 tp8): singletons, and one rank set
    made again for each dimension that spans it. Now one communicator per distinct rank set, none for one rank."""
    dims = _dims(shape)
    for rank in (0, dims.world_size - 1):
        made, topology = _created_groups(monkeypatch, dims, rank)
        assert made == planned_groups(dims) and len(made) == groups, (shape, rank)
        assert len({tuple(r) for r in made}) == len(made) and all(1 < len(r) < dims.world_size for r in made)
        for name in GROUP_NAMES:  # every dimension's group is the one made for its ranks, the world's, or none
            ranks, group = topology.ranks(name), topology.group(name)
            want = None if len(ranks) == 1 else topology_module.dist.group.WORLD if len(ranks) == dims.world_size else \
                ("group", tuple(ranks))
            assert group == want, (shape, rank, name)


# --- real groups against torch's DeviceMesh ----------------------------------------------------------------------


def compare_with_device_mesh(shapes: list[tuple[int, ...]]) -> list[dict]:
    """On every rank, for each layout: our group ranks and coordinates next to DeviceMesh's, and a live check."""
    import torch

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for shape in shapes:
        pp, dp, cp, tp, ep = shape
        topology = Topology(_dims(shape), rank, world)
        meshes = [init_device_mesh("cpu", (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp")),
                  init_device_mesh("cpu", (pp, dp * cp, tp), mesh_dim_names=("pp", "dp_cp", "tp")),
                  init_device_mesh("cpu", (pp, dp * cp // ep, ep, tp), mesh_dim_names=("pp", "edp", "ep", "tp"))]
        theirs, ours = {}, {}
        for mesh in meshes:
            for name in mesh.mesh_dim_names:
                theirs[name] = (dist.get_process_group_ranks(mesh.get_group(name)), mesh.get_local_rank(name))
                group = topology.group(name)  # none for a group of one: it needs no communicator
                ours[name] = (topology.ranks(name) if group is None else dist.get_process_group_ranks(group),
                              topology.coord(name))
                assert (group is None) == (topology.size(name) == 1), (name, shape)
        # The groups work: summing the global ranks over each group gives the sum of its members.
        sums = {}
        for name in GROUP_NAMES:
            t = torch.tensor([float(rank)])
            topology.comm(name).all_reduce(t)
            sums[name] = (float(t), float(sum(topology.ranks(name))))
        out.append(dict(shape=shape, theirs=theirs, ours=ours, sums=sums, prev=topology.pp_prev_rank,
                        next=topology.pp_next_rank, pp_ranks=topology.ranks("pp"), pp=topology.coord("pp")))
    return out, _refuses_non_member()


def _refuses_non_member() -> bool:
    """A Comm over a group this rank is not in is refused with a clear message."""
    group = dist.new_group([0])
    if dist.get_rank() == 0:
        return Comm(group).size == 1
    try:
        Comm(group)
    except ValueError as error:
        return "not a member" in str(error)
    return False


@pytest.mark.parametrize("world_size, shapes", [(8, SHAPES_8), (4, SHAPES_4)])
def test_groups_equal_device_mesh_groups(world_size: int, shapes) -> None:
    per_rank = run_ranks(compare_with_device_mesh, world_size, shapes, timeout=120)
    assert all(refused for _, refused in per_rank), "a Comm over a group this rank is not in must be refused"
    for rank, (results, _) in enumerate(per_rank):
        for r in results:
            for name, (their_ranks, their_coord) in r["theirs"].items():
                assert r["ours"][name] == (their_ranks, their_coord), (rank, r["shape"], name)
            for name, (got, expected) in r["sums"].items():
                assert got == expected, (rank, r["shape"], name)
            pp_ranks, i = r["pp_ranks"], r["pp"]
            assert r["prev"] == (pp_ranks[i - 1] if i > 0 else None)
            assert r["next"] == (pp_ranks[i + 1] if i + 1 < len(pp_ranks) else None)
