"""Resharded resume: a checkpoint written by one layout (dp, tp, pp, cp, ep, ZeRO stage, virtual stages) read by
any other, and the full model read back from a checkpoint of any layout.

Every rank file of a checkpoint (minidist.train.checkpoint) holds `pieces`, and no other copy of the model: the parts of
the full model and of its optimizer state that this rank is the first holder of. A piece is one local tensor,
flattened, plus the elements of the full tensor it holds, as *runs*: (start, length) in the row-major flattened
full tensor, in the piece's own element order. Everything a layout holds is such a list of runs:

    a tensor-parallel block split on dim 0                  one run
    a block split on the last dim ([rows, cols/tp])         one run per row
    a block of experts ([E/ep, d, h], dim 0)                one run
    ZeRO's flat range of a (tp-local) parameter             a sub-range of its block's runs (cut at both ends)

ZeRO's flat ranges are not rectangles, so a rectangle-only resharder (torch.distributed.checkpoint's chunks) would
need them gathered first; runs describe both without any communication. The runs come from the parameter's
`Placement` (parallel/placement.py: offsets and shapes of its splits) and, under ZeRO, from the ranges
`ParallelModel.owned_ranges()` lists.

One writer per piece: among the ranks holding the same piece only the first writes it (dp_cp and edp replicas
without ZeRO, copies of a kv head over tp, parameters whole on every tp or ep rank); ZeRO's slices are disjoint over
its group, so each owner writes its own. meta.json lists every piece (name, full shape, the state kinds it holds,
file, position, runs). The runs are stored compressed as groups (start, length, count, stride): a rectangle is one
group per row-major level outside its last split dim (a matrix split on its last dim: one group, whatever its rows),
a ZeRO range at most three, so the index grows with the number of pieces (parameters × shards), not with elements
or rows (tests/test_reshard.py's model, 39 tensors: 39 entries on one process, 69 under tp2, 44 under dp2
ZeRO-3, each one group; meta.json 15-25 kB).

Loading in another layout: each rank computes the runs of everything it now holds (parameters, each optimizer state
tensor shaped like one, persistent buffers such as the MoE router biases), finds the pieces of meta.json whose runs
intersect them, and copies the intersections (a merge walk of two sorted run lists). It opens only the files it
needs: checked against meta.json's size and SHA-256 first, then `torch.load(weights_only=True, mmap=True)`, so
the bytes read are those of the pieces that intersect. Every element must be found, or the load is refused in one
line. A scalar such as Adam's step count is taken from the first piece read. The layout that wrote a checkpoint
loads it the same way: the values copied are the saved numbers, so its resume is bit for bit (tests/test_checkpoint.py,
a resharded load saved again reads back bit for bit: tests/test_reshard.py). The pieces are views of the model's and
the optimizer's storages, so a file holds each saved element once; a dp replica's file holds no parameter at all
(dp2: the checkpoint is the size of one process's, tp2 one model's: tests/test_reshard.py measures both).

The run state that does not depend on the layout (LR schedule, sampler position: the global data order is the same
in every layout; the param groups' settings) is in rank 0's file only (minidist.train.run_state). The random generators
are in every rank's file: the same layout restores each rank's own; another restores rank 0's on every rank
(nothing in a training step draws from them: no dropout, no router noise; they are restored so that every rank
starts in a defined state).
What cannot be resharded is refused by run_state (SAME_RUN_KEYS: the model, the data, batch size, sequence length,
seed); the micro-batches, the schedule and every parallel setting may change.

`read_full_model(checkpoint_step_dir)` returns {name: full fp32 tensor} (parameters and persistent buffers, names of
the one-process model) from a checkpoint of any layout, checking that every element is written exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from minidist.comm.topology import Topology
from minidist.parallel import ParallelModel
from minidist.parallel.placement import Placement, placement_of
from minidist.train import checkpoint

# The groups a ZeRO engine's slices are disjoint over: replication over these is already one writer per element.
INSIDE = {"dp_cp": {"dp_cp", "dp", "cp", "ep", "edp"}, "edp": {"edp"}}


# ---------------------------------------------------------------------------------------------------------------
# Runs: (start, length) in the flattened full tensor, in the local tensor's element order
# ---------------------------------------------------------------------------------------------------------------


def block_runs(full_shape: tuple[int, ...], offsets: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    """[n, 2] int64 runs of the row-major block `shape` at `offsets` of a tensor of `full_shape` (runs are index
    bookkeeping, on the host whatever the model's device)."""
    strides = [1] * len(full_shape)
    for d in range(len(full_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * full_shape[d + 1]
    cut = [d for d in range(len(full_shape)) if shape[d] != full_shape[d]]
    numel = int(torch.tensor(shape, dtype=torch.int64, device="cpu").prod()) if shape else 1
    if not cut:
        return torch.tensor([[0, numel]], dtype=torch.int64, device="cpu")
    k = cut[-1]  # dims after k are whole: each run spans shape[k] of them
    starts = torch.tensor([sum(o * s for o, s in zip(offsets, strides))], dtype=torch.int64, device="cpu")
    for d in range(k):  # outer dims, outermost first: row-major order of the runs
        starts = (starts[:, None] + torch.arange(shape[d], dtype=torch.int64, device="cpu") * strides[d]).reshape(-1)
    return torch.stack([starts, torch.full_like(starts, shape[k] * strides[k])], dim=1)


def placement_runs(placement: Placement, local_shape: tuple[int, ...]) -> torch.Tensor:
    """The runs of a parameter's local tensor, from its placement."""
    return block_runs(tuple(placement.full_shape), placement.offsets(), tuple(local_shape))


def sub_runs(runs: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The runs of local elements [start, stop) of a tensor whose runs are `runs` (a ZeRO range of a block)."""
    ends = runs[:, 1].cumsum(0)
    begins = ends - runs[:, 1]
    keep = (ends > start) & (begins < stop)
    out, begins, ends = runs[keep].clone(), begins[keep], ends[keep]
    head = (start - begins).clamp(min=0)  # cut off the elements before `start` in the first run
    tail = (ends - stop).clamp(min=0)
    out[:, 0] += head
    out[:, 1] -= head + tail
    return out


def compress(runs: torch.Tensor) -> list[list[int]]:
    """Runs as groups [start, length, count, stride]: consecutive runs of one length at a constant stride."""
    groups: list[list[int]] = []
    for start, length in runs.tolist():
        if groups and groups[-1][1] == length:
            first, _, count, stride = groups[-1]
            if count == 1:  # a second run of the same length fixes the stride
                groups[-1][2:] = [2, start - first]
                continue
            if start == first + count * stride:
                groups[-1][2] += 1
                continue
        groups.append([start, length, 1, 0])
    return groups


def expand(groups: list[list[int]]) -> torch.Tensor:
    """The inverse of `compress`."""
    host = torch.device("cpu")
    parts = [torch.stack([s + torch.arange(c, dtype=torch.int64, device=host) * st,
                          torch.full((c,), n, dtype=torch.int64, device=host)], 1) for s, n, c, st in groups]
    return torch.cat(parts) if parts else torch.zeros((0, 2), dtype=torch.int64, device=host)


def copy_runs(dst: torch.Tensor, dst_runs: torch.Tensor, src: torch.Tensor, src_runs: torch.Tensor) -> int:
    """Copy into flat `dst` the elements of flat `src` that both hold (each as sorted, disjoint runs); return how
    many were copied. A merge walk: O(runs of both), each copy one contiguous slice."""
    a, b = dst_runs.tolist(), src_runs.tolist()
    a_at, b_at = _local_offsets(a), _local_offsets(b)
    i = j = copied = 0
    while i < len(a) and j < len(b):
        (a0, an), (b0, bn) = a[i], b[j]
        lo, hi = max(a0, b0), min(a0 + an, b0 + bn)
        if lo < hi:
            dst[a_at[i] + lo - a0:a_at[i] + hi - a0] = src[b_at[j] + lo - b0:b_at[j] + hi - b0]
            copied += hi - lo
        if a0 + an <= b0 + bn:
            i += 1
        else:
            j += 1
    return copied


def _local_offsets(runs: list[list[int]]) -> list[int]:
    out, at = [], 0
    for _, n in runs:
        out.append(at)
        at += n
    return out


# ---------------------------------------------------------------------------------------------------------------
# What this rank holds
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Piece:
    """One local tensor of the full model: flat `value` (a view: filling it fills the model or the shard), its runs,
    the optimizer whose state is keyed by `key` (None: no optimizer state here), whether this rank writes it."""

    name: str
    full_shape: tuple[int, ...]
    runs: torch.Tensor
    value: torch.Tensor
    optimizer: torch.optim.Optimizer | None
    key: torch.Tensor | None
    writer: bool


def local_pieces(parallel: ParallelModel, topo: Topology) -> list[Piece]:
    """Every local tensor of this rank's `ParallelModel` as a piece: parameters (whole, or ZeRO's slices with their
    optimizer state: `ParallelModel.owned_ranges`) and persistent buffers."""
    model: nn.Module = parallel.model
    owned = parallel.owned_ranges()
    whole = {r.name: r for r in owned if r.sharded_over is None}
    pieces = []
    for name, param in model.named_parameters():
        if param.numel() == 0:  # ZeRO-3: the values live in the shards (below)
            continue
        placement = placement_of(param)
        own = whole.get(name)  # not sharded by ZeRO: the whole parameter carries its optimizer state
        pieces.append(Piece(name, tuple(placement.full_shape), placement_runs(placement, tuple(param.shape)),
                            param.data.view(-1), own.optimizer if own else None, param if own else None,
                            own is not None and _first_holder(placement, topo, set())))
    for r in owned:
        if r.sharded_over is not None:  # ZeRO's slice of a parameter, with its optimizer state
            runs = sub_runs(placement_runs(r.placement, r.shape), r.start, r.stop)
            pieces.append(Piece(r.name, tuple(r.placement.full_shape), runs, r.key.view(-1), r.optimizer, r.key,
                                _first_holder(r.placement, topo, INSIDE[r.sharded_over])))
    names = dict(model.named_buffers())
    first = topo.coord("tp") == 0 and topo.coord("dp_cp") == 0
    for name in model.state_dict():
        if name in names:  # persistent buffers (router biases): whole on every rank of their stage
            buf = names[name]
            runs = torch.tensor([[0, buf.numel()]], device="cpu")
            pieces.append(Piece(name, tuple(buf.shape), runs, buf.view(-1), None, None, first))
    return pieces


def _first_holder(placement: Placement, topo: Topology, covered: set[str]) -> bool:
    """Whether this rank is the first of the ranks holding this same piece: index 0 of every group it is copied
    over (a split's `replicas` ranks hold each slice; `replicated_over` groups hold it whole), except the groups a
    ZeRO engine already cuts it over (`covered`)."""
    for group, split in placement.splits.items():
        if group not in covered and topo.coord(group) % split.replicas:
            return False
    return all(topo.coord(group) == 0 for group in placement.replicated_over if group not in covered)


# ---------------------------------------------------------------------------------------------------------------
# Save: this rank's pieces and their index entries
# ---------------------------------------------------------------------------------------------------------------


def pieces_to_save(parallel: ParallelModel, topo: Topology) -> tuple[list[dict], list[dict]]:
    """(tensors for this rank's file, index entries for meta.json) of the pieces this rank writes: views of the
    model and optimizer state where they cover their storage (torch.save writes a storage once, whole), copies
    where they do not (ZeRO-1/2's shard is a slice of the bucket of every rank's parameters)."""
    tensors, index = [], []
    for piece in local_pieces(parallel, topo):
        if not piece.writer:
            continue
        saved = {"value": piece.value}
        state = piece.optimizer.state.get(piece.key, {}) if piece.optimizer is not None else {}
        for kind, item in state.items():
            if isinstance(item, torch.Tensor) and item.numel() == piece.value.numel() and item.dim() > 0:
                saved[kind] = item.view(-1)
            elif isinstance(item, torch.Tensor | int | float):
                saved[kind] = torch.as_tensor(item, device="cpu").detach().clone()
        index.append({"name": piece.name, "shape": list(piece.full_shape), "kinds": sorted(saved),
                      "position": len(tensors), "runs": compress(piece.runs)})
        tensors.append(saved)
    return _without_unsaved_bytes(tensors), index


def _without_unsaved_bytes(tensors: list[dict]) -> list[dict]:
    """Copy the tensors that are views of a storage the saved tensors do not cover (the rest of it would be written
    too: at ZeRO-1/2, every rank's parameters); the others stay views (no copy in memory)."""
    covered: dict[int, int] = {}
    for saved in tensors:
        for t in saved.values():
            key = t.untyped_storage().data_ptr()
            covered[key] = covered.get(key, 0) + t.numel() * t.element_size()
    return [{kind: t if covered[t.untyped_storage().data_ptr()] >= t.untyped_storage().nbytes() else t.clone()
             for kind, t in saved.items()} for saved in tensors]


# ---------------------------------------------------------------------------------------------------------------
# Load: fill this rank's pieces from any layout's checkpoint
# ---------------------------------------------------------------------------------------------------------------


class PieceReader:
    """meta.json's index of a checkpoint directory, and its files opened on demand (checked, then mapped)."""

    def __init__(self, step_dir: Path, meta: dict) -> None:
        self.step_dir, self.files = step_dir, meta["files"]
        self.entries: dict[str, list[dict]] = {}
        listed = meta.get("pieces")
        if not isinstance(listed, list):
            raise ValueError(f"{step_dir / checkpoint.META} lists no pieces: it is not a trainer's checkpoint "
                             "(minidist.train.run_state)")
        seen = set()
        for entry in listed:
            entry = self._checked(entry)
            if (entry["file"], entry["position"]) in seen:  # two names for one saved tensor: one of them is wrong
                raise ValueError(f"{step_dir / checkpoint.META} lists piece {entry['position']} of {entry['file']} "
                                 "twice")
            seen.add((entry["file"], entry["position"]))
            self.entries.setdefault(entry["name"], []).append(entry)
        self.opened: dict[str, Any] = {}

    def _checked(self, entry: Any) -> dict:
        where = f"{self.step_dir / checkpoint.META}: a piece"
        ok = (isinstance(entry, dict) and isinstance(entry.get("name"), str) and entry.get("file") in self.files
              and type(entry.get("position")) is int and entry["position"] >= 0 and _int_lists(entry.get("shape"), 1)
              and all(n > 0 for n in entry["shape"])
              and isinstance(entry.get("kinds"), list) and all(isinstance(k, str) for k in entry["kinds"])
              and _int_lists(entry.get("runs"), 2))
        if not ok:
            raise ValueError(f"{where} is malformed (name, file, position, shape, kinds, runs)")
        numel = int(torch.tensor(entry["shape"], dtype=torch.int64, device="cpu").prod()) if entry["shape"] else 1
        groups = entry["runs"]
        if any(len(g) != 4 or g[1] < 1 or g[2] < 1 or g[3] < 0 for g in groups) or sum(g[2] for g in groups) > numel:
            raise ValueError(f"{where} of {entry['name']} has run groups that are not [start, length >= 1, count "
                             f">= 1, stride >= 0] or more runs than its {numel} elements")  # before expanding them
        runs = expand(groups)
        ends = runs[:, 0] + runs[:, 1]
        if len(runs) == 0 or (runs[:, 1] <= 0).any() or (runs[:, 0] < 0).any() or ends[-1] > numel or (
                ends[:-1] > runs[1:, 0]).any():
            raise ValueError(f"{where} of {entry['name']} has runs that are not sorted, disjoint and inside "
                             f"its shape {entry['shape']}")
        return {**entry, "runs": runs}

    def open(self, name: str) -> Any:
        """A rank file's contents, checked against meta.json and mapped (once): only the bytes used are read."""
        if name not in self.opened:
            path = self.step_dir / name
            if name not in self.files:
                raise ValueError(f"{path} is not listed in meta.json")
            self.opened[name] = checkpoint.read_rank_file(path, self.files[name], mmap=True)
        return self.opened[name]

    def tensor(self, entry: dict, kind: str) -> torch.Tensor:
        """The saved flat tensor `kind` of a piece."""
        name = entry["file"]
        try:
            value = self.open(name)["pieces"][entry["position"]][kind]
        except (KeyError, IndexError, TypeError):
            value = None
        total = int(entry["runs"][:, 1].sum())
        if not isinstance(value, torch.Tensor) or (value.dim() > 0 and value.numel() != total):
            raise ValueError(f"{self.step_dir / name} does not hold the {kind} of piece {entry['position']} "
                             f"({entry['name']}, {total} elements) that meta.json lists")
        return value

    def fill(self, name: str, full_shape: tuple[int, ...], runs: torch.Tensor, out: torch.Tensor,
             kind: str = "value") -> dict:
        """Fill flat `out` (elements `runs` of `name`) from the saved pieces; return the first piece read.
        One-line ValueError if the checkpoint lacks an element or the full shapes differ."""
        entries = self.entries.get(name)
        if not entries:
            raise ValueError(f"checkpoint {self.step_dir.name} holds no {name}")
        lo, hi = int(runs[0, 0]), int((runs[:, 0] + runs[:, 1]).max())
        copied, first = 0, None
        for entry in entries:
            if tuple(entry["shape"]) != tuple(full_shape):
                raise ValueError(f"checkpoint {self.step_dir.name} holds {name} of shape {entry['shape']}, "
                                 f"this model's is {list(full_shape)}")
            r = entry["runs"]
            if kind not in entry["kinds"] or int(r[0, 0]) >= hi or int(r[-1, 0] + r[-1, 1]) <= lo:
                continue
            n = copy_runs(out, runs, self.tensor(entry, kind).to(out.dtype), r)
            if n:
                copied, first = copied + n, first or entry
        if copied != out.numel():
            raise ValueError(f"checkpoint {self.step_dir.name} lacks {out.numel() - copied} of the {out.numel()} "
                             f"elements of {name} ({kind}) this rank needs")
        return first


def load_pieces(parallel: ParallelModel, topo: Topology, reader: PieceReader) -> None:
    """Fill this rank's parameters, buffers and optimizer state from a checkpoint of any layout."""
    for piece in local_pieces(parallel, topo):
        with torch.no_grad():
            first = reader.fill(piece.name, piece.full_shape, piece.runs, piece.value)
        if piece.optimizer is None:
            continue
        state = {}
        for kind in [k for k in first["kinds"] if k != "value"]:
            saved = reader.tensor(first, kind)
            if saved.dim() == 0:  # a scalar (Adam's step): where a fresh optimizer would keep it
                state[kind] = saved.clone().to(_scalar_device(piece.optimizer, piece.key))
            else:
                state[kind] = torch.empty_like(piece.value)
                reader.fill(piece.name, piece.full_shape, piece.runs, state[kind], kind)
                state[kind] = state[kind].view_as(piece.key)
        if state:
            piece.optimizer.state[piece.key] = state


def _scalar_device(optimizer: torch.optim.Optimizer, key: torch.Tensor) -> torch.device:
    group = next(g for g in optimizer.param_groups if any(p is key for p in g["params"]))
    return key.device if group.get("fused") or group.get("capturable") else torch.device("cpu")


def _int_lists(value: Any, depth: int) -> bool:
    if depth == 1:
        return isinstance(value, list) and all(type(v) is int for v in value)
    return isinstance(value, list) and all(_int_lists(v, depth - 1) for v in value)


def read_full_model(checkpoint_step_dir: Path) -> dict[str, torch.Tensor]:
    """{name: full tensor} of every parameter and persistent buffer, named as in the one-process model, from a
    checkpoint directory (e.g. OUT/checkpoints/step_000100) of any layout. Every element must be written exactly
    once; anything else is a one-line ValueError."""
    return read_full(checkpoint_step_dir, "value")


def read_full(checkpoint_step_dir: Path, kind: str) -> dict[str, torch.Tensor]:
    """{name: full tensor} of one kind of state: "value", or an optimizer state shaped like the parameter
    ("exp_avg", "exp_avg_sq" for AdamW), for every name that has it."""
    step_dir = Path(checkpoint_step_dir)
    match = checkpoint.STEP_NAME.fullmatch(step_dir.name)
    if match is None:
        raise ValueError(f"{step_dir} is not a checkpoint directory (a name like step_000100)")
    meta = checkpoint.load_meta(step_dir.parent, int(match.group(1)))
    reader = PieceReader(step_dir, meta)
    out = {}
    for name, entries in reader.entries.items():
        entries = [e for e in entries if kind in e["kinds"]]
        if not entries:
            continue
        shape = tuple(entries[0]["shape"])
        written = sum(int(e["runs"][:, 1].sum()) for e in entries)
        full = torch.empty(shape, dtype=reader.tensor(entries[0], kind).dtype, device="cpu")
        runs = torch.cat([e["runs"] for e in entries])
        runs = runs[runs[:, 0].argsort()]
        overlap = bool((runs[:-1, 0] + runs[:-1, 1] > runs[1:, 0]).any())  # with the count: each element once
        if written != full.numel() or overlap:
            raise ValueError(f"checkpoint {step_dir.name} writes {written} elements of {name} ({kind}), which has "
                             f"{full.numel()}{', some twice' if overlap else ''}: each must be written exactly once")
        reader.fill(name, shape, torch.tensor([[0, full.numel()]], device="cpu"), full.view(-1), kind)
        out[name] = full
    return out
