"""Collectives built by hand from point-to-point messages, the graduated versions of notebook 00's.

`ring_reduce_scatter`, `ring_all_gather` and `ring_all_reduce` are the bandwidth-optimal ring (Patarasuk & Yuan
2009); `naive_all_reduce` (gather to one rank, reduce, send back) is there for contrast, and `pairwise_all_to_all`
exchanges with one peer per step. Each takes a `Comm`, whose ledger records the bytes their messages actually
carried under the function's own name, or a bare process group (None: the world). The ring functions cut tensors
exactly as `torch.tensor_split` does, so their ledger entries equal `minidist.comm.communicator.ring_bytes_sent`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from minidist.comm.communicator import Comm, Handle


def _wait_all(handles: list[Handle]) -> None:
    for h in handles:
        h.wait()


CommLike = Comm | dist.ProcessGroup | None


def _as_comm(comm: CommLike) -> Comm:
    """The hand-built collectives take a Comm (whose ledger records them) or a bare group (None: the world)."""
    return comm if isinstance(comm, Comm) else Comm(comm)


def _ring_step(comm: Comm, send: torch.Tensor, recv: torch.Tensor) -> int:
    """Send `send` to the next rank while receiving `recv` from the previous one; return the bytes sent."""
    p, r = comm.size, comm.rank
    handles, sent = comm.post_unrecorded([(send, (r + 1) % p)], [(recv, (r - 1) % p)])
    _wait_all(handles)
    return sent


def _reduce_scatter_phase(chunks: Sequence[torch.Tensor], comm: Comm) -> int:
    """Ring reduce-scatter over `chunks` in place: afterwards chunk r of rank r holds the sum. Returns bytes sent.

    Step s: rank r sends chunk r-s-1 (its running sum) to r+1, receives chunk r-s-2 from r-1 and adds its own.
    """
    p, r = comm.size, comm.rank
    sent = 0
    for s in range(p - 1):
        target = chunks[(r - s - 2) % p]
        incoming = torch.empty_like(target)
        sent += _ring_step(comm, chunks[(r - s - 1) % p], incoming)
        target.add_(incoming)
    return sent


def _all_gather_phase(chunks: Sequence[torch.Tensor], comm: Comm) -> int:
    """Ring all-gather over `chunks` in place, rank r starting with chunk r. Returns bytes sent.

    Step s: rank r forwards chunk r-s to r+1 and receives chunk r-s-1 from r-1 straight into place.
    """
    p, r = comm.size, comm.rank
    sent = 0
    for s in range(p - 1):
        sent += _ring_step(comm, chunks[(r - s) % p], chunks[(r - s - 1) % p])
    return sent


def ring_reduce_scatter(tensor: torch.Tensor, comm: CommLike = None) -> torch.Tensor:
    """Sum `tensor` over the group; return chunk `comm.rank` of `torch.tensor_split(sum, p, dim=0)` (any dim-0 size).

    `tensor` is left unchanged. Ledger ("ring_reduce_scatter"): the bytes actually sent, M - |c_r|.
    """
    comm = _as_comm(comm)
    work = tensor.contiguous().clone()
    chunks = torch.tensor_split(work, comm.size, dim=0)
    sent = _reduce_scatter_phase(chunks, comm) if comm.size > 1 else 0
    comm.ledger.record("ring_reduce_scatter", comm.name, sent)
    return chunks[comm.rank].clone()


def ring_all_gather(tensor: torch.Tensor, comm: CommLike = None, sizes: Sequence[int] | None = None) -> torch.Tensor:
    """Concatenate every rank's `tensor` along dim 0.

    `sizes[j]` is rank j's dim-0 size; by default every rank's is the same. Uneven sizes make this the inverse of
    `ring_reduce_scatter`. Ledger ("ring_all_gather"): the bytes actually sent, M - |c_r+1| (M = the output).
    """
    comm = _as_comm(comm)
    p, r = comm.size, comm.rank
    sizes = [tensor.shape[0]] * p if sizes is None else list(sizes)
    if len(sizes) != p or sizes[r] != tensor.shape[0]:
        raise ValueError(f"sizes {sizes} must have {p} entries with sizes[{r}] = this rank's dim 0 ({tensor.shape[0]})")
    out = tensor.new_empty((sum(sizes), *tensor.shape[1:]))
    chunks = torch.split(out, sizes, dim=0)
    chunks[r].copy_(tensor)
    sent = _all_gather_phase(chunks, comm) if p > 1 else 0
    comm.ledger.record("ring_all_gather", comm.name, sent)
    return out


def ring_all_reduce(tensor: torch.Tensor, comm: CommLike = None) -> torch.Tensor:
    """Sum `tensor` (contiguous, any size) over the group in place and return it: reduce-scatter + all-gather.

    Ledger ("ring_all_reduce"): the bytes actually sent, 2M - |c_r| - |c_r+1| (= 2(p-1)/p·M when p divides numel).
    """
    comm = _as_comm(comm)
    if not tensor.is_contiguous():
        raise ValueError("ring_all_reduce works in place and needs a contiguous tensor; pass tensor.contiguous()")
    chunks = torch.tensor_split(tensor.view(-1), comm.size)
    sent = 0
    if comm.size > 1:
        sent = _reduce_scatter_phase(chunks, comm) + _all_gather_phase(chunks, comm)
    comm.ledger.record("ring_all_reduce", comm.name, sent)
    return tensor


def naive_all_reduce(tensor: torch.Tensor, comm: CommLike = None) -> torch.Tensor:
    """Sum in place by gathering everything on group rank 0, adding, and sending the sum back to each rank.

    Rank 0 sends (p-1)·M bytes and every other rank M: the root's link carries p/2 times what a ring rank sends.
    Ledger ("naive_all_reduce"): the bytes actually sent.
    """
    comm = _as_comm(comm)
    p, r = comm.size, comm.rank
    sent = 0
    if p > 1:
        if r == 0:
            incoming = torch.empty_like(tensor)
            for src in range(1, p):
                _wait_all(comm.post_unrecorded([], [(incoming, src)])[0])
                tensor.add_(incoming)
            handles, sent = comm.post_unrecorded([(tensor, dst) for dst in range(1, p)], [])
            _wait_all(handles)
        else:
            handles, sent = comm.post_unrecorded([(tensor, 0)], [])
            _wait_all(handles)
            _wait_all(comm.post_unrecorded([], [(tensor, 0)])[0])
    comm.ledger.record("naive_all_reduce", comm.name, sent)
    return tensor


def pairwise_all_to_all(tensor: torch.Tensor, comm: CommLike, in_splits: Sequence[int],
                        out_splits: Sequence[int]) -> torch.Tensor:
    """All-to-all from point-to-point messages: at step s, send to rank r+s and receive from rank r-s.

    Same meaning as `Comm.all_to_all`. Ledger ("pairwise_all_to_all"): the bytes actually sent.
    """
    comm = _as_comm(comm)
    p, r = comm.size, comm.rank
    out = tensor.new_empty((sum(out_splits), *tensor.shape[1:]))
    pieces_in = torch.split(tensor.contiguous(), list(in_splits), dim=0)
    pieces_out = torch.split(out, list(out_splits), dim=0)
    pieces_out[r].copy_(pieces_in[r])
    sent = 0
    for s in range(1, p):
        dst, src = (r + s) % p, (r - s) % p
        handles, n = comm.post_unrecorded([(pieces_in[dst], dst)], [(pieces_out[src], src)])
        _wait_all(handles)
        sent += n
    comm.ledger.record("pairwise_all_to_all", comm.name, sent)
    return out
