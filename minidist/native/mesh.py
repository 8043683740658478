"""The rank grid as a `DeviceMesh` (torch.distributed.device_mesh), and back.

minidist lays the ranks of a layout on a grid of shape (pp, dp, cp, tp), tp fastest (`comm.topology.rank_grid`). A
`DeviceMesh` is exactly such an n-dimensional array of ranks with a name per dimension: the process group of mesh
dimension d holds the ranks that agree on every other coordinate, which is minidist's definition of a group. So the
mesh of a layout is its rank grid, unchanged; the combined groups are meshes of the same ranks reshaped:

    "grid"      (pp, dp, cp, tp)        the four dimensions
    "replicas"  (pp, dp_cp, tp)         dp and cp merged: the ranks holding the same parameters
    "experts"   (pp, edp, ep, tp)       dp_cp split as (edp, ep), ep fastest (ep carved out of dp_cp)

minidist's "tied" group (the first and last pipeline stage, a middle stage alone) is not a mesh dimension: its
groups are not all the same size.
"""

from __future__ import annotations

import torch

from minidist.comm.topology import ParallelDims, rank_grid

MESH_DIMS: dict[str, tuple[str, ...]] = {"grid": ("pp", "dp", "cp", "tp"), "replicas": ("pp", "dp_cp", "tp"),
                                         "experts": ("pp", "edp", "ep", "tp")}


def mesh_shape(dims: ParallelDims, kind: str = "grid") -> tuple[int, ...]:
    """The sizes of the mesh `kind` of `dims`, in the order of MESH_DIMS[kind]."""
    sizes = {"pp": dims.pp, "dp": dims.dp, "cp": dims.cp, "tp": dims.tp, "dp_cp": dims.dp * dims.cp,
             "ep": dims.ep, "edp": dims.dp * dims.cp // dims.ep}
    if kind not in MESH_DIMS:
        raise ValueError(f"unknown mesh {kind!r}; choose one of {', '.join(MESH_DIMS)}")
    return tuple(sizes[name] for name in MESH_DIMS[kind])


def mesh_ranks(dims: ParallelDims, kind: str = "grid") -> torch.Tensor:
    """The ranks of the mesh `kind` as an int tensor: minidist's rank grid, reshaped (no rank moves)."""
    return rank_grid(dims).reshape(mesh_shape(dims, kind))


def device_mesh(dims: ParallelDims, kind: str = "grid", device_type: str = "cpu"):
    """The `DeviceMesh` of `dims` (a collective call on every rank of the job: it creates a group per dimension)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, mesh_ranks(dims, kind), mesh_dim_names=MESH_DIMS[kind])


def dims_of_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> ParallelDims:
    """The minidist degrees of a mesh of `shape` with dimension `names` (e.g. `mesh.shape`, `mesh.mesh_dim_names`):
    any subset of pp, dp, cp, tp (a missing one is 1), or of pp, dp_cp (taken as dp), tp, or pp, edp, ep, tp."""
    if len(shape) != len(names):
        raise ValueError(f"a mesh of shape {tuple(shape)} needs {len(shape)} names, got {tuple(names)}")
    sizes = dict(zip(names, shape))
    unknown = sorted(set(sizes) - {"pp", "dp", "cp", "tp", "dp_cp", "edp", "ep"})
    if unknown or ("dp_cp" in sizes and {"dp", "cp"} & set(sizes)) or ("edp" in sizes) != ("ep" in sizes):
        raise ValueError(f"mesh dims {tuple(names)} are not one of minidist's meshes {list(MESH_DIMS.values())}"
                         + (f" (unknown: {unknown})" if unknown else ""))
    if "ep" in sizes:
        dp, ep = sizes["edp"] * sizes["ep"], sizes["ep"]
    else:
        dp, ep = sizes.get("dp", sizes.get("dp_cp", 1)), 1
    return ParallelDims(dp=dp, tp=sizes.get("tp", 1), pp=sizes.get("pp", 1), cp=sizes.get("cp", 1), ep=ep)


def mesh_groups(ranks: torch.Tensor, names: tuple[str, ...], name: str) -> list[list[int]]:
    """The groups of mesh dimension `name` read off a rank array (each a sorted list; sorted), as DeviceMesh forms
    them: the ranks that agree on every other coordinate."""
    axis = names.index(name)
    rows = ranks.movedim(axis, -1).reshape(-1, ranks.shape[axis])
    return sorted(sorted(row) for row in rows.tolist())


def all_layouts(world_size: int) -> list[ParallelDims]:
    """Every ParallelDims of `world_size` ranks: each (pp, dp, cp, tp) whose product is the world, each ep dividing
    dp·cp."""
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    found = []
    for pp in divisors:
        for dp in divisors:
            for cp in divisors:
                rest, left = divmod(world_size, pp * dp * cp)
                if left or rest < 1:
                    continue
                found += [ParallelDims(dp=dp, tp=rest, pp=pp, cp=cp, ep=ep)
                          for ep in range(1, dp * cp + 1) if (dp * cp) % ep == 0]
    return found
