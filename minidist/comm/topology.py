"""The rank grid: which rank does what, and the process group of every parallel dimension.

Every rank of a run sits at one point of a 4-D grid of shape (pp, dp, cp, tp). The grid is laid out in row-major
order with **tp varying fastest**, then cp, then dp, then pp (the torchtitan / Megatron-LM convention):

    rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i

Why this order: tensor parallelism talks most (several collectives per layer), so its ranks are neighbours (on a real
cluster: the GPUs of one node); pipeline parallelism talks least (one activation per micro-batch), so its ranks are
farthest apart.

A *group* of dimension d is a set of ranks that agree on every coordinate except d. Combined dimensions are sets that
agree on every coordinate except those listed:

    "pp", "dp", "cp", "tp"  one dimension each
    "dp_cp"                 dp and cp together: the ranks that hold the same parameters (same pp stage, same tp
                            shard); dense gradients are averaged over this group
    "ep"                    expert parallelism, carved out of dp_cp. The dp_cp index e = dp_i * cp + cp_i is split as
                            e = edp_i * ep + ep_i, ep fastest, so an ep group is ep consecutive members of a dp_cp
                            group (ep must divide dp * cp). The ranks of one ep group hold different experts.
    "edp"                   expert data parallel: the dp_cp ranks with the same ep_i, i.e. the ranks holding the same
                            experts; expert gradients are averaged over this group (size dp * cp / ep)
    "tied"                  the first and the last pipeline stage of one pipeline (same dp, cp, tp), which hold the
                            two copies of a tied embedding and sum their gradients; a middle stage (or pp = 1) is a
                            group of its own. Index 0 on the first stage, 1 on the last
    "world"                 every rank

The pure functions (`rank_grid`, `coordinates`, `group_ranks`) need no torch.distributed; `Topology` builds the real
process groups from them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from minidist.comm.communicator import Comm, Ledger

if TYPE_CHECKING:
    from minidist.comm.recorder import FlightRecorder

GRID_ORDER = ("pp", "dp", "cp", "tp")  # slowest to fastest varying
GROUP_NAMES = ("pp", "dp", "cp", "tp", "dp_cp", "ep", "edp", "tied", "world")


@dataclass(frozen=True)
class ParallelDims:
    """The degree of each parallelism. dp * tp * pp * cp must equal the world size; ep must divide dp * cp."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if (self.dp * self.cp) % self.ep != 0:
            fits = [d for d in range(1, self.dp * self.cp + 1) if (self.dp * self.cp) % d == 0]
            raise ValueError(f"ep={self.ep} does not divide dp*cp={self.dp * self.cp} (ep is carved from dp*cp); "
                             f"ep in {fits} would fit")

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The grid's shape in GRID_ORDER: (pp, dp, cp, tp)."""
        return (self.pp, self.dp, self.cp, self.tp)

    def validate(self, world_size: int) -> None:
        """Raise a one-line ValueError unless these degrees exactly fill `world_size` ranks."""
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if self.world_size == world_size:
            return
        others = self.tp * self.pp * self.cp
        if world_size % others == 0:
            hint = f"dp={world_size // others} would fit"
        else:
            hint = f"tp*pp*cp={others} does not divide {world_size} either; pick tp, pp, cp whose product divides it"
        culprit = [f"{n}={getattr(self, n)}" for n in ("dp", "tp", "pp", "cp")
                   if getattr(self, n) > 1 and world_size % getattr(self, n) != 0]
        what = f"{', '.join(culprit)} does not divide world_size={world_size}" if culprit else \
            f"dp*tp*pp*cp={self.world_size} != world_size={world_size}"
        raise ValueError(f"{self} does not fit {world_size} ranks: {what}; {hint}")


def rank_grid(dims: ParallelDims) -> torch.Tensor:
    """All ranks laid out as an int tensor of shape (pp, dp, cp, tp), tp fastest (on the host: bookkeeping)."""
    return torch.arange(dims.world_size, device="cpu").reshape(dims.shape)


def coordinates(dims: ParallelDims, rank: int) -> dict[str, int]:
    """A rank's index along every dimension, including the derived ones (dp_cp, ep, edp)."""
    if not 0 <= rank < dims.world_size:
        raise ValueError(f"rank {rank} is outside 0..{dims.world_size - 1} for {dims}")
    pp_i, rest = divmod(rank, dims.dp * dims.cp * dims.tp)
    dp_i, rest = divmod(rest, dims.cp * dims.tp)
    cp_i, tp_i = divmod(rest, dims.tp)
    dp_cp_i = dp_i * dims.cp + cp_i
    edp_i, ep_i = divmod(dp_cp_i, dims.ep)
    tied_i = 1 if dims.pp > 1 and pp_i == dims.pp - 1 else 0
    return {"pp": pp_i, "dp": dp_i, "cp": cp_i, "tp": tp_i, "dp_cp": dp_cp_i, "ep": ep_i, "edp": edp_i,
            "tied": tied_i, "world": rank}


def group_ranks(dims: ParallelDims, name: str) -> list[list[int]]:
    """Every group of dimension `name`, as sorted lists of global ranks, in a fixed order (the same on all ranks)."""
    grid = rank_grid(dims)  # (pp, dp, cp, tp)
    pp, dp, cp, tp = dims.shape
    if name == "world":
        return [list(range(dims.world_size))]
    if name == "tied":  # pipeline ends paired (first with last), every middle stage's rank alone
        ends = grid[[0, pp - 1]].reshape(min(pp, 2), -1).T.tolist() if pp > 1 else []
        alone = grid[1:pp - 1] if pp > 1 else grid
        return sorted([sorted(row) for row in ends] + [[r] for r in alone.reshape(-1).tolist()])
    if name in GRID_ORDER:
        axis = GRID_ORDER.index(name)
        # Move the axis last; each row of the flattened rest is one group.
        rows = grid.movedim(axis, -1).reshape(-1, grid.shape[axis])
    elif name in ("dp_cp", "ep", "edp"):
        # (pp, dp*cp, tp) -> split dp*cp as (edp, ep), ep fastest.
        split = grid.reshape(pp, dp * cp // dims.ep, dims.ep, tp)
        if name == "dp_cp":
            rows = grid.reshape(pp, dp * cp, tp).movedim(1, -1).reshape(-1, dp * cp)
        elif name == "ep":
            rows = split.movedim(2, -1).reshape(-1, dims.ep)
        else:
            rows = split.movedim(1, -1).reshape(-1, dp * cp // dims.ep)
    else:
        raise ValueError(f"unknown group {name!r}; expected one of {GROUP_NAMES}")
    return sorted(sorted(row) for row in rows.tolist())


def planned_groups(dims: ParallelDims) -> list[list[int]]:
    """The rank sets a `Topology` creates with `dist.new_group`, in the order every rank creates them: each distinct
    set of two or more ranks among the grid's groups, but every rank's (the default group serves it). A dp8 job
    needs none; a group of one rank would be a communicator that never talks, and two dimensions spanning the same
    ranks (dp and dp_cp when cp is 1) one communicator twice (on NCCL each costs GPU memory and start-up time)."""
    world = list(range(dims.world_size))
    seen: dict[tuple[int, ...], None] = {}
    for name in GROUP_NAMES:
        for ranks in group_ranks(dims, name):
            if len(ranks) > 1 and ranks != world:
                seen.setdefault(tuple(ranks))
    return [list(ranks) for ranks in seen]


class Topology:
    """One rank's view of the grid: its coordinates and the process group of every dimension.

    Construction is collective: every rank must build its Topology with the same `dims`, because each
    `dist.new_group` call must be made by all ranks in the same order. Only the groups of `planned_groups` are
    created; a group of one rank has none (`group()` returns None and its `Comm` is the identity), and with
    world_size 1 no process group exists at all.
    `timeout`: how long any collective of the groups made here may wait for a peer before it raises (None: torch's
    default, 30 min under gloo, 10 under NCCL); the world group's is set where it is created (`init_process_group`).
    `recorder`: the flight recorder every `comm()` records into (None: no recording).
    `ckpt_timeout`: when given, one more group over every rank with this timeout (`checkpoint_comm`), for the
    barriers that wait while ranks write and hash files: a slow filesystem must not hit the collectives' timeout.
    `device`: the rank's compute device; every `comm()` then refuses a tensor elsewhere (`Comm.expect_device`), as
    NCCL would on a GPU.
    """

    def __init__(self, dims: ParallelDims, rank: int, world_size: int,
                 timeout: datetime.timedelta | None = None, recorder: FlightRecorder | None = None,
                 ckpt_timeout: datetime.timedelta | None = None,
                 device: torch.device | str | None = None) -> None:
        dims.validate(world_size)
        if world_size > 1 and not (dist.is_initialized() and dist.get_world_size() == world_size):
            actual = dist.get_world_size() if dist.is_initialized() else "not initialised"
            raise ValueError(f"Topology for {world_size} ranks needs torch.distributed initialised with "
                             f"{world_size} ranks (it has {actual})")
        self.dims = dims
        self.recorder = recorder  # every Comm of `comm()` records its calls here (minidist.comm.recorder)
        self.device = torch.device(device) if device is not None else None
        self.rank = rank
        self.world_size = world_size
        self.coords = coordinates(dims, rank)
        self._ranks: dict[str, list[int]] = {r: next(g for g in group_ranks(dims, r) if rank in g) for r in GROUP_NAMES}
        made: dict[tuple[int, ...], dist.ProcessGroup] = {}
        if world_size > 1:
            made[tuple(range(world_size))] = dist.group.WORLD
            for ranks in planned_groups(dims):  # collective: every rank, members or not, in one agreed order
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    made[tuple(ranks)] = group
        # A group of one needs no communicator (its Comm is the identity); equal rank sets share one.
        self._groups = {name: made.get(tuple(ranks)) for name, ranks in self._ranks.items()}
        # After the grid's groups, in the same order on every rank (new_group is collective).
        self._checkpoint_group = dist.new_group(list(range(world_size)), timeout=ckpt_timeout) \
            if world_size > 1 and ckpt_timeout is not None else self._groups["world"]

    @classmethod
    def from_env(cls, dims: ParallelDims) -> Topology:
        """Build from the initialised default group, or as a single rank when torch.distributed is not in use."""
        if dist.is_available() and dist.is_initialized():
            return cls(dims, dist.get_rank(), dist.get_world_size())
        return cls(dims, 0, 1)

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group of dimension `name` that contains this rank (None for a group of one rank: no
        communicator; the world's when the group spans every rank)."""
        self._check(name)
        return self._groups[name]

    def ranks(self, name: str) -> list[int]:
        """Global ranks of this rank's group along `name`, in group-rank order."""
        self._check(name)
        return list(self._ranks[name])

    def size(self, name: str) -> int:
        self._check(name)
        return len(self._ranks[name])

    def coord(self, name: str) -> int:
        """This rank's index within its `name` group (equal to its group rank)."""
        self._check(name)
        return self.coords[name]

    def comm(self, name: str, ledger: Ledger | None = None) -> Comm:
        """A `Comm` over this rank's `name` group, recording into `ledger` under the group name `name`."""
        group = self.group(name)
        solo = self._ranks[name][0] if group is None and self.world_size > 1 else None
        return Comm(group, ledger, name=name, recorder=self.recorder, expect_device=self.device, solo_rank=solo)

    def checkpoint_comm(self) -> Comm:
        """A `Comm` over every rank whose timeout is the checkpoint's (`ckpt_timeout`; the world's without one)."""
        return Comm(self._checkpoint_group, name="checkpoint", recorder=self.recorder, expect_device=self.device)

    @property
    def pp_prev_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (None on the first stage)."""
        i = self.coords["pp"]
        return self._ranks["pp"][i - 1] if i > 0 else None

    @property
    def pp_next_rank(self) -> int | None:
        """Global rank of the next pipeline stage (None on the last stage)."""
        i = self.coords["pp"]
        return self._ranks["pp"][i + 1] if i + 1 < self.dims.pp else None

    def _check(self, name: str) -> None:
        if name not in GROUP_NAMES:
            raise ValueError(f"unknown group {name!r}; expected one of {GROUP_NAMES}")

    def __repr__(self) -> str:
        coords = ", ".join(f"{n}={self.coords[n]}" for n in GRID_ORDER)
        return f"Topology({self.dims}, rank={self.rank}: {coords})"
