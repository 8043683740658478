"""Chapter 00 exercises, answered: ring reduce-scatter and ring all-reduce from point-to-point messages.

Both functions follow Patarasuk & Yuan (2009): the ranks of the group form a ring, every rank sends to its right
neighbour and receives from its left one, and the tensor travels in p chunks so that every link is busy at every
step. Only `isend` / `irecv` are used.
"""

import torch
import torch.distributed as dist


def ring_reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum `tensor` over `group`; return this rank's chunk of the sum (see exercises/ch00_collectives.py)."""
    group = group if group is not None else dist.group.WORLD
    p = dist.get_world_size(group)
    me = dist.get_rank(group)  # my position in the ring (my rank within the group)
    right = dist.get_global_rank(group, (me + 1) % p)  # send/recv take global ranks
    left = dist.get_global_rank(group, (me - 1) % p)

    chunks = list(torch.tensor_split(tensor.contiguous().clone(), p, dim=0))
    for step in range(p - 1):
        # My running sum of chunk (me - step - 1) moves right; the left neighbour's sum of (me - step - 2) arrives.
        outgoing = chunks[(me - step - 1) % p]
        arriving = (me - step - 2) % p
        buffer = torch.empty_like(chunks[arriving])
        recv_req = dist.irecv(buffer, src=left, group=group)  # post both before waiting on either
        send_req = dist.isend(outgoing.contiguous(), dst=right, group=group)
        recv_req.wait()
        send_req.wait()
        chunks[arriving] += buffer
    # After p-1 steps, chunk `me` has collected all p contributions, the last one being mine.
    return chunks[me]


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum `tensor` over `group` in place and return it (see exercises/ch00_collectives.py)."""
    group = group if group is not None else dist.group.WORLD
    p = dist.get_world_size(group)
    me = dist.get_rank(group)
    right = dist.get_global_rank(group, (me + 1) % p)
    left = dist.get_global_rank(group, (me - 1) % p)

    flat = tensor.view(-1)  # chunks of a flat view are contiguous and write straight into `tensor`
    chunks = torch.tensor_split(flat, p)

    def exchange(outgoing: torch.Tensor, incoming: torch.Tensor) -> None:
        recv_req = dist.irecv(incoming, src=left, group=group)
        send_req = dist.isend(outgoing, dst=right, group=group)
        recv_req.wait()
        send_req.wait()

    # Phase 1, reduce-scatter: afterwards I hold the full sum of chunk `me`.
    for step in range(p - 1):
        arriving = chunks[(me - step - 2) % p]
        buffer = torch.empty_like(arriving)
        exchange(chunks[(me - step - 1) % p], buffer)
        arriving += buffer

    # Phase 2, all-gather: pass the finished chunks around the ring, receiving each straight into place.
    for step in range(p - 1):
        exchange(chunks[(me - step) % p], chunks[(me - step - 1) % p])
    return tensor
