"""Every byte the course sends goes through here, and is written in a ledger.

A `Comm` wraps one process group and one `Ledger`; each collective or point-to-point call is forwarded to
torch.distributed and recorded as (op, group name) -> calls, bytes sent by this rank. The collectives built by hand
from point-to-point messages live in `minidist.comm.p2p_collectives`, the α-β cost model in `minidist.comm.cost_model`.

What "bytes sent per rank" means for the torch collectives
-----------------------------------------------------------
torch (gloo) does not tell us what it sends, so the ledger records what the bandwidth-optimal ring algorithm sends
from this rank. Let M be the full tensor's size in bytes (for all-gather: the gathered output; for reduce-scatter:
the input), p the group size and r this rank's index in the group. The ring cuts the tensor into p chunks
c_0..c_{p-1} exactly as `torch.tensor_split` does (along dim 0 for all-gather / reduce-scatter, over the flattened
tensor for all-reduce and broadcast); rank r sends to r+1 and receives from r-1.

    reduce_scatter  M - |c_r|                      rank r ends owning chunk r, it forwards every other chunk once
    all_gather      M - |c_{r+1}|                  it forwards every chunk but the last one it receives
    all_reduce      2M - |c_r| - |c_{r+1}|         reduce-scatter then all-gather
    broadcast       scatter from the source (it sends every chunk but its own: M - |c_src|) then a ring all-gather
                    (M - |c_{r+1}| on every rank); the long-message broadcast of Thakur et al. 2005
    all_to_all      the bytes of every split except the one this rank keeps for itself
    send            the tensor's bytes; recv records a call and 0 bytes

When p divides the chunked dimension, these are exactly the textbook figures: all-reduce 2(p-1)/p·M, all-gather and
reduce-scatter (p-1)/p·M, broadcast 2(p-1)/p·M on the source and (p-1)/p·M elsewhere. Otherwise they are the exact
integer counts of the ring with uneven chunks; summed over the ranks they are always 2(p-1)·M and (p-1)·M. A group
of one rank sends nothing (calls are still counted). The hand-built ring functions of `minidist.comm.p2p_collectives`
use the same chunks and schedule, so their measured ledger entries equal these formulas exactly.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from minidist.comm.recorder import FlightRecorder

# torch 2.13 deprecates the names the package calls because torch 2.11 has no other (`comm.torch_support`): its
# FutureWarning, once per rank and run, says nothing the user can act on. That one message only.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is "
                        "deprecated", category=FutureWarning)

# ---------------------------------------------------------------------------------------------------------------
# Ledger
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Ledger:
    """Calls and bytes sent by this rank, per (op, group name). One per rank; return it from a rank to read it."""

    entries: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    def record(self, op: str, group: str, nbytes: int, calls: int = 1) -> None:
        entry = self.entries.setdefault((op, group), [0, 0])
        entry[0] += calls
        entry[1] += int(nbytes)

    def bytes(self, op: str | None = None, group: str | None = None) -> int:
        """Bytes sent, summed over the entries matching `op` and `group` (None matches all)."""
        return sum(b for (o, g), (_, b) in self.entries.items() if op in (None, o) and group in (None, g))

    def calls(self, op: str | None = None, group: str | None = None) -> int:
        return sum(c for (o, g), (c, _) in self.entries.items() if op in (None, o) and group in (None, g))

    def totals(self) -> dict[tuple[str, str], dict[str, int]]:
        """{(op, group): {"calls": n, "bytes": b}} for every entry."""
        return {key: {"calls": c, "bytes": b} for key, (c, b) in sorted(self.entries.items())}

    def reset(self) -> None:
        self.entries.clear()

    def table(self) -> str:
        """A small text table, one line per (op, group)."""
        lines = [f"{'op':<22}{'group':<12}{'calls':>8}{'bytes':>14}"]
        for (op, group), t in self.totals().items():
            lines.append(f"{op:<22}{group:<12}{t['calls']:>8}{t['bytes']:>14}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Byte formulas (the ring's exact per-rank counts, see the module docstring)
# ---------------------------------------------------------------------------------------------------------------


def chunk_sizes(n: int, p: int) -> list[int]:
    """Sizes of the p pieces torch.tensor_split cuts n items into: the first n % p pieces get one extra item."""
    return [n // p + (1 if i < n % p else 0) for i in range(p)]


def ring_bytes_sent(op: str, shape: Sequence[int], element_size: int, p: int, rank: int, src: int = 0) -> int:
    """Bytes the ring algorithm sends from group rank `rank` for collective `op` on a tensor of `shape`.

    `shape` is the full tensor: the input for all_reduce / reduce_scatter / broadcast, the gathered output for
    all_gather. `src` is the source's group rank for broadcast.
    """
    if p == 1:
        return 0
    numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    total = numel * element_size
    if op in ("all_reduce", "broadcast"):
        unit, n = element_size, numel  # chunked over the flattened tensor
    elif op in ("all_gather", "reduce_scatter"):
        n = shape[0]
        unit = total // n if n else 0  # bytes of one row
    else:
        raise ValueError(f"no ring byte formula for {op!r}; expected all_reduce, all_gather, reduce_scatter, broadcast")
    c = [s * unit for s in chunk_sizes(n, p)]
    if op == "reduce_scatter":
        return total - c[rank]
    if op == "all_gather":
        return total - c[(rank + 1) % p]
    if op == "all_reduce":
        return 2 * total - c[rank] - c[(rank + 1) % p]
    scatter = total - c[src] if rank == src else 0
    return scatter + total - c[(rank + 1) % p]


# ---------------------------------------------------------------------------------------------------------------
# Comm: one group + one ledger
# ---------------------------------------------------------------------------------------------------------------

_REDUCE_OPS = {"sum": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


class Handle:
    """What an async_op=True call returns: `wait()` blocks until done and returns the output tensor."""

    def __init__(self, work: dist.Work | None, output: torch.Tensor | None,
                 after: Callable[[], None] | None = None, origin: tuple | None = None) -> None:
        self._work, self._output, self._after, self._done = work, output, after, False
        self.origin = origin  # (Comm, op, flight-record seq or None): what a failed wait() names (trust.health)

    def wait(self) -> torch.Tensor | None:
        if not self._done:
            if self._work is not None:
                recorder = self.origin[0].recorder if self.origin is not None else None
                if recorder is None:
                    self._work.wait()
                else:  # the flight record says which call a rank is blocked in (a rank blocked in none is stuck
                    recorder.waiting_on = self.origin[2]  # elsewhere: minidist.debug.diff names it); a wait that
                    self._work.wait()  # raises (a timeout) leaves it set: the record written then names the call
                    recorder.waiting_on = None
            if self._after is not None:
                self._after()
            self._done = True
        return self._output

    @property
    def output(self) -> torch.Tensor | None:
        """The output buffer: its contents are final only once `wait()` has returned."""
        return self._output

    def is_completed(self) -> bool:
        return self._done or self._work is None or self._work.is_completed()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    """A process group plus a ledger. Peers (`src`, `dst`, `peer`) are ranks *within this group*.

    `group=None` means the default (world) group when torch.distributed is initialised, and a single rank when it
    is not; a single-rank Comm makes every collective the identity without touching torch.distributed. `solo_rank`
    (with no group): a group of this one rank, global rank `solo_rank`, that needs no process group (a `Topology`
    makes no communicator for a group of one). Every collective returns its output tensor, or with `async_op=True`
    a `Handle` whose `wait()` returns it.

    Device and dtype check: with `expect_device` (and `expect_dtypes`), or inside `with comm.expecting(device,
    dtypes):`, every tensor handed to a collective or point-to-point call must live on that device with one of those
    dtypes, or the call raises before it communicates. NCCL takes only tensors on the rank's GPU, and both ends of a
    message must agree on its dtype; a CPU run with device "cpu" checks the same discipline where no GPU is. The
    Comms of a `Topology` built with a device (the trainer's) always check it; `device` is where to make tensors.

    Flight recorder: with `recorder` (a `minidist.comm.recorder.FlightRecorder`), every call of a group of two or
    more ranks is appended to it (op, shapes, dtype, peer, call site) before it communicates.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, ledger: Ledger | None = None,
                 name: str | None = None, *, expect_device: torch.device | str | None = None,
                 expect_dtypes: Iterable[torch.dtype] | None = None, recorder: FlightRecorder | None = None,
                 solo_rank: int | None = None) -> None:
        self.ledger = ledger if ledger is not None else Ledger()
        self.expect_device = torch.device(expect_device) if expect_device is not None else None
        self.expect_dtypes = frozenset(expect_dtypes) if expect_dtypes is not None else None
        if solo_rank is not None:
            if group is not None:
                raise ValueError("solo_rank is a group of one without a process group; pass no group with it")
            self.group, self.ranks, self.rank = None, [solo_rank], 0
        elif dist.is_available() and dist.is_initialized():
            self.group = group if group is not None else dist.group.WORLD
            if self.group == dist.GroupMember.NON_GROUP_MEMBER:
                raise ValueError("this rank is not a member of the group; build a Comm only on the group's members")
            self.ranks = dist.get_process_group_ranks(self.group)
            self.rank = dist.get_rank(self.group)
        else:
            if group is not None:
                raise ValueError("a group was given but torch.distributed is not initialised")
            self.group, self.ranks, self.rank = None, [0], 0
        self.size = len(self.ranks)
        if name is None:
            name = "world" if self.group in (None, dist.group.WORLD) else "ranks" + ",".join(map(str, self.ranks))
        self.name = name
        self.recorder = recorder if self.size > 1 else None  # a group of one never waits for anybody
        self.last_call: tuple[str, int | None] = ("?", None)  # (op, seq) of the latest recorded call
        self._ranks_key = tuple(self.ranks)

    @property
    def device(self) -> torch.device:
        """Where a tensor for this Comm is made: the device it expects (the rank's compute device), else the CPU."""
        return self.expect_device if self.expect_device is not None else torch.device("cpu")

    def global_rank(self, group_rank: int) -> int:
        """The global rank of this group's member number `group_rank`."""
        return self.ranks[group_rank]

    def __repr__(self) -> str:
        return f"Comm({self.name}: ranks {self.ranks}, me={self.rank})"

    # -- helpers --------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def expecting(self, device: torch.device | str, dtypes: Iterable[torch.dtype] | None = None) -> Iterator[Comm]:
        """Within the block, check every tensor handed to this Comm: on `device`, of a dtype in `dtypes` (if given)."""
        before = self.expect_device, self.expect_dtypes
        self.expect_device = torch.device(device)
        self.expect_dtypes = frozenset(dtypes) if dtypes is not None else None
        try:
            yield self
        finally:
            self.expect_device, self.expect_dtypes = before

    def _check(self, op: str, *tensors: torch.Tensor | None) -> None:
        """Test mode (see the class docstring): ValueError for a tensor off the expected device or dtypes."""
        want = self.expect_device
        for t in tensors:
            if t is None:
                continue
            if want is not None and (t.device.type != want.type or want.index not in (None, t.device.index)):
                raise ValueError(f"{op} on {self.name}: a tensor {tuple(t.shape)} on {t.device}, but this Comm "
                                 f"expects {want}")
            if self.expect_dtypes is not None and t.dtype not in self.expect_dtypes:
                raise ValueError(f"{op} on {self.name}: a tensor {tuple(t.shape)} of {t.dtype}, but this Comm "
                                 f"expects {sorted(map(str, self.expect_dtypes))}")

    def _record(self, op: str, tensor: torch.Tensor, peer: int | None = None, batch: int | None = None,
                detail: str | None = None) -> int | None:
        """Append this call to the flight recorder, if any; `peer` is a group rank. Returns the record's seq."""
        self.last_call = (op, None)
        if self.recorder is None:
            return None
        seq = self.recorder.record(self.name, self._ranks_key, op, tuple(tensor.shape), tensor.dtype,
                                   None if peer is None else self.ranks[peer], batch, detail)
        self.last_call = (op, seq)
        return seq

    def _finish(self, work, output: torch.Tensor | None, async_op: bool,
                after: Callable[[], None] | None = None):
        handle = Handle(work, output, after, (self, *self.last_call) if work is not None else None)
        return handle if async_op else handle.wait()

    def _reduce_op(self, op: str) -> dist.ReduceOp:
        if op not in _REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(_REDUCE_OPS)}")
        return getattr(dist.ReduceOp, _REDUCE_OPS[op])

    # -- collectives ----------------------------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False):
        """Reduce `tensor` in place over the group (op: sum, avg, max, min, product). Ledger: 2M - |c_r| - |c_r+1|."""
        reduce_op = self._reduce_op(op)
        self._check("all_reduce", tensor)
        self.ledger.record("all_reduce", self.name,
                           ring_bytes_sent("all_reduce", tensor.shape, tensor.element_size(), self.size, self.rank))
        if self.size == 1:
            return self._finish(None, tensor, async_op)
        self._record("all_reduce", tensor, detail=op)
        work = dist.all_reduce(tensor, op=reduce_op, group=self.group, async_op=True)
        after = (lambda: tensor.div_(self.size)) if op == "avg" else None  # gloo has no AVG
        return self._finish(work, tensor, async_op, after)

    def all_gather(self, tensor: torch.Tensor, out: torch.Tensor | None = None, async_op: bool = False):
        """Concatenate every rank's `tensor` (same shape everywhere) along dim 0. Ledger: M - |c_r+1|, M = output."""
        self._check("all_gather", tensor, out)
        if out is None:
            out = tensor.new_empty((self.size * tensor.shape[0], *tensor.shape[1:]) if tensor.dim() else (self.size,))
        self.ledger.record("all_gather", self.name,
                           ring_bytes_sent("all_gather", out.shape, out.element_size(), self.size, self.rank))
        if self.size == 1:
            out.copy_(tensor.reshape(out.shape))
            return self._finish(None, out, async_op)
        self._record("all_gather", tensor)
        work = dist.all_gather_into_tensor(out, tensor.contiguous(), group=self.group, async_op=True)
        return self._finish(work, out, async_op)

    def reduce_scatter(self, tensor: torch.Tensor, out: torch.Tensor | None = None, op: str = "sum",
                       async_op: bool = False):
        """Reduce over the group; rank r gets rows [r·n, (r+1)·n) (p must divide dim 0). Ledger: M - |c_r|."""
        reduce_op = self._reduce_op(op)
        self._check("reduce_scatter", tensor, out)
        if tensor.shape[0] % self.size != 0:
            raise ValueError(f"reduce_scatter needs dim 0 ({tensor.shape[0]}) divisible by the group size "
                             f"{self.size}; pad it, or use p2p_collectives.ring_reduce_scatter for uneven chunks")
        if out is None:
            out = tensor.new_empty((tensor.shape[0] // self.size, *tensor.shape[1:]))
        self.ledger.record("reduce_scatter", self.name,
                           ring_bytes_sent("reduce_scatter", tensor.shape, tensor.element_size(), self.size, self.rank))
        if self.size == 1:
            out.copy_(tensor)
            return self._finish(None, out, async_op)
        self._record("reduce_scatter", tensor, detail=op)
        work = dist.reduce_scatter_tensor(out, tensor.contiguous(), op=reduce_op, group=self.group, async_op=True)
        after = (lambda: out.div_(self.size)) if op == "avg" else None
        return self._finish(work, out, async_op, after)

    def all_to_all(self, tensor: torch.Tensor, out: torch.Tensor | None = None,
                   in_splits: Sequence[int] | None = None, out_splits: Sequence[int] | None = None,
                   async_op: bool = False):
        """Rank r sends rows in_splits[j] of `tensor` to rank j, and receives out_splits[j] rows from rank j.

        Without splits the rows are divided evenly. With uneven `in_splits`, pass `out_splits` too: a rank cannot
        know what it will receive (exchange the counts first with an all_to_all of a small tensor).
        Ledger: the bytes of every split but the one kept by this rank.
        """
        self._check("all_to_all", tensor, out)
        p = self.size
        rows = tensor.shape[0]
        if in_splits is None:
            if rows % p:
                raise ValueError(f"all_to_all without in_splits needs dim 0 ({rows}) divisible by {p}")
            in_splits = [rows // p] * p
        if len(in_splits) != p or sum(in_splits) != rows:
            raise ValueError(f"in_splits {list(in_splits)} must have {p} entries summing to dim 0 = {rows}")
        if out_splits is None:
            if len(set(in_splits)) > 1:
                raise ValueError("uneven in_splits need out_splits: exchange the counts first (an all_to_all of "
                                 "a tensor of p counts)")
            out_splits = list(in_splits)  # even: every rank receives what it sends
        if len(out_splits) != p:
            raise ValueError(f"out_splits {list(out_splits)} must have {p} entries")
        if out is None:
            out = tensor.new_empty((sum(out_splits), *tensor.shape[1:]))
        elif out.shape[0] != sum(out_splits):
            raise ValueError(f"out has {out.shape[0]} rows but out_splits {list(out_splits)} sum to {sum(out_splits)}")
        row_bytes = _nbytes(tensor) // rows if rows else 0
        self.ledger.record("all_to_all", self.name, (rows - in_splits[self.rank]) * row_bytes)
        if p == 1:
            out.copy_(tensor)
            return self._finish(None, out, async_op)
        self._record("all_to_all", tensor)  # its rows may differ across ranks (uneven splits), the rest may not
        work = dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=list(out_splits),
                                      input_split_sizes=list(in_splits), group=self.group, async_op=True)
        return self._finish(work, out, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, async_op: bool = False):
        """Copy group rank `src`'s `tensor` into `tensor` on every rank. Ledger: scatter + ring all-gather bytes."""
        self._check("broadcast", tensor)
        self.ledger.record("broadcast", self.name, ring_bytes_sent("broadcast", tensor.shape, tensor.element_size(),
                                                                   self.size, self.rank, src=src))
        if self.size == 1:
            return self._finish(None, tensor, async_op)
        self._record("broadcast", tensor, detail=f"src={src}")
        work = dist.broadcast(tensor, src=self.global_rank(src), group=self.group, async_op=True)
        return self._finish(work, tensor, async_op)

    def barrier(self, device: torch.device | None = None) -> None:
        """Wait for every rank of the group. On NCCL, `device` names this rank's GPU (device_ids), which NCCL would
        otherwise guess from the rank number (wrong when ranks are not laid out on GPUs in order)."""
        if self.size > 1:
            seq = None if self.recorder is None else self.recorder.record(self.name, self._ranks_key, "barrier", (),
                                                                          None)
            device_ids = [device.index] if device is not None and device.type == "cuda" else None
            self.last_call = ("barrier", seq)
            if self.recorder is not None:
                self.recorder.waiting_on = seq  # left set if the barrier raises (see Handle.wait)
            dist.barrier(group=self.group, device_ids=device_ids)
            if self.recorder is not None:
                self.recorder.waiting_on = None

    # -- point to point -------------------------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.isend(tensor, dst).wait()

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.irecv(tensor, src).wait()

    def isend(self, tensor: torch.Tensor, dst: int) -> Handle:
        """Start sending `tensor` to group rank `dst`; do not modify `tensor` before wait()."""
        self._check("isend", tensor)
        self.ledger.record("send", self.name, _nbytes(tensor))
        self._record("send", tensor, peer=dst)
        return Handle(dist.isend(tensor.contiguous(), dst=self.global_rank(dst), group=self.group), tensor,
                      origin=(self, *self.last_call))

    def irecv(self, tensor: torch.Tensor, src: int) -> Handle:
        """Start receiving into `tensor` (contiguous) from group rank `src`; wait() returns it."""
        self._check("irecv", tensor)
        self.ledger.record("recv", self.name, 0)
        self._record("recv", tensor, peer=src)
        return Handle(dist.irecv(tensor, src=self.global_rank(src), group=self.group), tensor,
                      origin=(self, *self.last_call))

    def exchange(self, sends: Iterable[tuple[torch.Tensor, int]] = (),
                 recvs: Iterable[tuple[torch.Tensor, int]] = ()) -> list[Handle]:
        """Post several sends and receives at once (batch_isend_irecv) so that no ordering can deadlock.

        `sends` and `recvs` are (tensor, group rank) pairs. Returns the handles torch gives: under gloo one per
        non-empty message, the receives first; under NCCL one for the whole batch (an NCCL group). Empty tensors
        are skipped (the peer skips its matching empty receive). Each send is recorded as a "send".
        """
        sends, recvs = list(sends), list(recvs)
        self._check("exchange", *(t for t, _ in sends + recvs))
        for t, _ in sends:
            if t.numel() > 0:
                self.ledger.record("send", self.name, _nbytes(t))
        handles, _ = self.post_unrecorded(sends, recvs)
        return handles

    def post_unrecorded(self, sends: Iterable[tuple[torch.Tensor, int]],
                        recvs: Iterable[tuple[torch.Tensor, int]]) -> tuple[list[Handle], int]:
        """Post the non-empty messages like `exchange`, record nothing, and return (handles, bytes sent).

        For callers that record the bytes themselves under their own op name (the hand-built collectives).
        """
        sends, recvs = list(sends), list(recvs)
        self._check("post_unrecorded", *(t for t, _ in sends + recvs))
        sends = [(t.contiguous(), peer) for t, peer in sends if t.numel() > 0]
        recvs = [(t, peer) for t, peer in recvs if t.numel() > 0]
        # Receives first: a receive posted before the matching data arrives lets it land in place.
        ops = [dist.P2POp(dist.irecv, t, self.global_rank(peer), self.group) for t, peer in recvs]
        ops += [dist.P2POp(dist.isend, t, self.global_rank(peer), self.group) for t, peer in sends]
        if not ops:
            return [], 0
        if self.recorder is not None:  # in posting order: receives first; one batch, named by its first record
            first = self.recorder.seq
            for kind, items in (("recv", recvs), ("send", sends)):
                for t, peer in items:
                    self._record(kind, t, peer=peer, batch=first)
        origin = (self, "send/recv batch", first if self.recorder is not None else None)
        return [Handle(w, None, origin=origin) for w in dist.batch_isend_irecv(ops)], sum(_nbytes(t) for t, _ in sends)
