"""Chapter 00 exercises: build reduce-scatter and all-reduce from point-to-point messages.

Grade your answers with `make grade CH=00`. The grader runs each function on 2, 3 and 4 ranks (and on a sub-group
of ranks 0, 2, ...), for tensors whose size does not divide by the number of ranks (1, 2, 7, 13, 1001 elements and a
5x3 matrix), and checks that:
  - the result equals torch.distributed's own collective;
  - you used only point-to-point messages (dist.isend / dist.irecv / dist.send / dist.recv / dist.batch_isend_irecv;
    calling dist.all_reduce and friends fails the test);
  - no rank sent more bytes than the ring needs: a bandwidth-optimal algorithm, not "everyone sends to rank 0".

Tools you need (all in torch.distributed, imported as `dist`):
  dist.get_world_size(group), dist.get_rank(group)   the group's size p and my index in it, 0..p-1
  dist.get_global_rank(group, i)                      the global rank of the group's member i; send/recv need these
  dist.isend(t, dst=..., group=group)                 start sending t; returns a request with .wait()
  dist.irecv(t, src=..., group=group)                 start receiving into t (same shape and dtype as what is sent)
  torch.tensor_split(t, p, dim=0)                     p nearly equal chunks (the first n % p are one longer); they
                                                      are views: writing into a chunk writes into t
When `group` is None, use dist.group.WORLD.
"""

import torch
import torch.distributed as dist


def ring_reduce_scatter(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum `tensor` over the ranks of `group` and return only this rank's chunk of the sum.

    Every rank passes a tensor of the same shape. Cut the sum along dim 0 into p chunks exactly as
    `torch.tensor_split(sum, p, dim=0)` does; group rank r returns chunk r. Any dim-0 size works, even one smaller
    than p (some chunks are then empty). You may use `tensor` as scratch space (or work on a clone).

    The ring algorithm (Patarasuk & Yuan 2009), with me = my group rank, right = me + 1 and left = me - 1 (mod p):
      1. Split a copy of the tensor into p chunks.
      2. Repeat for step = 0 .. p-2:
           send my chunk (me - step - 1) mod p to `right`, and at the same time receive the left neighbour's
           chunk (me - step - 2) mod p into a temporary buffer; then add the buffer into my own copy of that chunk.
      3. Chunk `me` now holds all p contributions: return it.
    Check the indices on paper for p = 3 first: which chunk does rank 0 send at step 0, and who adds what to it?

    Hints:
      - Post the send and the receive before waiting on either (isend, irecv, then wait both). A blocking send to
        the right while the right neighbour is also blocked sending would deadlock.
      - The received buffer must have the shape of the chunk being received, which is not always the one you send
        (uneven chunks): allocate it with torch.empty_like(chunks[the index you receive]).
      - send/recv take global ranks: a sub-group {0, 2} has members 0 and 1, which are global ranks 0 and 2.
      - Each rank sends p-1 chunks: about (p-1)/p of the tensor's bytes.
    """
    raise NotImplementedError("exercise: build ring_reduce_scatter from dist.isend / dist.irecv")


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum `tensor` over the ranks of `group` in place, and return it.

    `tensor` is contiguous and has the same shape on every rank, of any size (not necessarily divisible by p).
    Afterwards every rank's `tensor` holds the elementwise sum, like dist.all_reduce(tensor).

    The ring all-reduce is a reduce-scatter followed by an all-gather, on the same p chunks:
      0. Split the *flattened* tensor into p chunks: chunks = torch.tensor_split(tensor.view(-1), p). They are
         views, so updating a chunk updates `tensor` itself.
      1. Reduce-scatter phase, for step = 0 .. p-2 (as in ring_reduce_scatter): send chunk (me - step - 1) to the
         right, receive chunk (me - step - 2) from the left into a buffer, add it into that chunk.
         Afterwards chunk `me` holds the complete sum.
      2. All-gather phase, for step = 0 .. p-2: send chunk (me - step) to the right (a finished one), receive
         chunk (me - step - 1) from the left directly into place (no addition: it is already the full sum).
    Each rank sends 2(p-1) chunks: about 2(p-1)/p of the tensor's bytes, whatever p is. That is the point: the
    naive "send everything to rank 0, add, send back" makes rank 0 send (p-1) whole tensors.

    Hints: the ones of ring_reduce_scatter apply. Write a small helper that sends one chunk right while receiving
    one from the left, and use it in both phases.
    """
    raise NotImplementedError("exercise: build ring_all_reduce from dist.isend / dist.irecv")
