"""Chapter 07 exercises: bucketed, overlapped gradient averaging with accumulation; which pieces ZeRO's rank owns.

Grade your answers with `make grade CH=07`.

- `bucketed_all_reduce` runs on 2 and 3 real ranks (tiny model, two bucket sizes, 1 and 2 micro-batches, two steps
  in a row). The grader checks every averaged gradient against one process's gradient of the whole global batch,
  that each step launches exactly one async all-reduce per bucket, in bucket order, of the sizes
  `minidist.parallel.dp.data_parallel.assign_buckets` gives, and that the first of them starts before backward ends
  (overlap).
- `zero_owned_pieces` is checked against the flat layout of `minidist.parallel.dp.data_parallel.Bucket` (its padding
  and `shard_range`): the pieces must pick exactly the elements a rank owns, and together cover every parameter once.
"""

from collections.abc import Callable

import torch.distributed as dist
from torch import nn


def bucketed_all_reduce(model: nn.Module, bucket_bytes: int, microbatches: int = 1,
                        group: dist.ProcessGroup | None = None) -> Callable[[], None]:
    """Attach bucketed, overlapped gradient averaging over `group` to `model`, with gradient accumulation; return
    a function `finish()` that the training loop calls after the last backward of each step.

    How the grader drives it (the same on every rank, each on its own rows of the global batch):

        finish = bucketed_all_reduce(model, bucket_bytes, microbatches=M)
        for step in range(2):
            for x, y in my_micro_batches(step):        # M of them
                (lm_loss(model(x), y) / M).backward()
            finish()                                   # now every p.grad = the average over ranks of the step's sum
            model.zero_grad(set_to_none=True)

    The notebook's `BucketedDP` (§3) does one backward per step. Yours must add up the gradients of M backward passes
    and communicate once, during the last one:

    1. Buckets. Walk `reversed(list(model.parameters()))` (backward produces the last layers' gradients first);
       start a new bucket when adding the next parameter's fp32 bytes (4·numel) to a non-empty bucket would exceed
       `bucket_bytes`. Each bucket gets one flat fp32 buffer of exactly its parameters' elements (no padding).
    2. Hooks. `param.register_post_accumulate_grad_hook(fn)` calls `fn(param)` once per backward, right after
       `param.grad` was accumulated. Add the gradient into the parameter's slice of its bucket, then set
       `param.grad = None` (otherwise the next micro-batch's gradient is added on top of it in .grad as well, and
       you would count it twice). Count the arrivals per bucket.
    3. Launch. A bucket is ready when all its parameters have delivered the gradient of the M-th backward, i.e.
       when it has counted M·len(bucket) arrivals. Launch ready buckets *in index order only*:
       `dist.all_reduce(flat, group=group, async_op=True)` returns a work object; keep it. If bucket 3 is ready
       before bucket 2, it waits: every rank must issue the same collectives in the same order, and a rank whose
       buckets fill in another order would deadlock or mix up tensors.
    4. `finish()`: wait on every work object, write flat-slice / world_size into each `param.grad` (shaped like the
       parameter, in its dtype), then reset the buffers and counters so that the next step starts from zero.

    Call collectives as `dist.all_reduce(...)` (the grader counts them through that name); no other collective is
    needed. Every parameter of the model receives a gradient in every backward here.

    Why: with k buckets the latency α is paid k times instead of once per tensor, and every bucket but the last is
    on the wire while backward still computes the earlier layers. Accumulating locally keeps the bytes per step
    those of one all-reduce of the model, whatever M is (the notebook's §4 checks both on the ledger).
    """
    raise NotImplementedError("exercise: bucketed, overlapped all-reduce hooks with gradient accumulation")


def zero_owned_pieces(numels: list[int], world: int, rank: int) -> list[tuple[int, int, int, int]]:
    """Which elements of which parameters rank `rank` of `world` owns in ZeRO's flat layout.

    ZeRO-1 lays the parameters of a bucket side by side in one flat vector: parameter i occupies
    [offset_i, offset_i + numels[i]) with offset_i = numels[0] + ... + numels[i-1]. The vector is padded with zeros
    to `padded`, the smallest multiple of `world` that is >= the total, so that every rank owns an equal slice:
    rank r owns [r·S, (r+1)·S) with S = padded / world. Its optimizer updates only those elements, so it has to
    know which parameter each of them belongs to (minidist rebuilds the user's optimizer over exactly these pieces).

    Return one tuple (i, start, stop, shard_offset) per parameter that overlaps the rank's slice, in parameter
    order: elements [start, stop) of parameter i (counted in its flattened form) are this rank's, and sit at
    positions [shard_offset, shard_offset + stop - start) of the rank's shard. Leave out parameters that do not
    overlap (no empty pieces) and the padding (it belongs to no parameter). A rank whose slice is all padding
    returns [].

    Check on paper first: numels = [5, 3, 8], world = 4, so S = 4. Rank 1 owns flat [4, 8): element 4 of parameter
    0 and all of parameter 1, giving [(0, 4, 5, 0), (1, 0, 3, 1)]. With numels = [7, 1, 13] (21 elements, padded
    to 24, S = 6), rank 3 owns [18, 24): elements 10..12 of parameter 2, then 3 zeros of padding.

    Hint: a piece is the intersection of [offset_i, offset_i + numels[i]) with [r·S, (r+1)·S); both bounds of the
    result are then shifted, once by offset_i (into the parameter) and once by r·S (into the shard).
    """
    raise NotImplementedError("exercise: intersect each parameter's range with the rank's slice of the padded layout")
