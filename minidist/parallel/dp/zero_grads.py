"""ZeRO's gradient reductions: a reduce-scatter where plain data parallelism all-reduces, so that rank r keeps only
the average of its slice of each bucket (`bucket.grad_shard`), the slice its optimizer updates.

Both plug into `DataParallel` (the `GradReduction` of minidist/parallel/dp/data_parallel.py: the same hooks, bucket
order and overlap); they differ in where the full gradient lives:

- `ReduceScatterOnce` (stage 1): full fp32 buckets live for the whole run and accumulate every micro-batch, as in
  plain data parallelism; the last micro-batch reduce-scatters each once. Reduce-scatter + the all-gather of the
  updated parameters = the bytes of one all-reduce.
- `ReduceScatterEveryMicrobatch` (stages 2-3): only the shard lives for the whole run. A bucket's full buffer is
  allocated by its first gradient of a backward and freed once its reduce-scatter has been added into the shard, so
  every micro-batch is reduced (`no_sync` cannot skip it: the full gradient it would need is gone).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minidist.comm.communicator import Comm, Handle
from minidist.memory import PeakBytes
from minidist.parallel.dp.data_parallel import AllReduceGrads, Bucket


def _reduce_scatter(comm: Comm, bucket: Bucket) -> Handle:
    # Into a fresh tensor: at stage 1 the shard is a view of the input, which a collective must not overwrite.
    # A sum: the strategy divides it by its divisor on completion (the group size, or dp·cp for expert weights).
    return comm.reduce_scatter(bucket.grad, out=torch.empty_like(bucket.grad_shard), op="sum", async_op=True)


class ReduceScatterOnce(AllReduceGrads):
    """ZeRO-1: accumulate in full buckets, reduce-scatter once per step; the shard is this rank's slice of them.
    Plain data parallelism's buckets and accumulation, with a reduce-scatter where it all-reduces."""

    def setup(self, bucket: Bucket) -> None:
        super().setup(bucket)
        start, stop = bucket.shard_range(self.comm.rank, self.comm.size)
        bucket.grad_shard = bucket.grad[start:stop]

    def launch(self, bucket: Bucket) -> Handle:
        return _reduce_scatter(self.comm, bucket)

    def complete(self, bucket: Bucket, result: torch.Tensor) -> None:
        bucket.grad_shard.copy_(result.div_(self.divisor))  # the local sum is replaced by the average over ranks

    def publish(self, bucket: Bucket) -> None:
        """Nothing: the optimizer reads the shards."""


class ReduceScatterEveryMicrobatch:
    """ZeRO-2/3: reduce-scatter every bucket of every backward into a persistent shard; full buckets are transient.

    `transient` counts the full buffers alive; `after_launch(bucket)` runs once a bucket's reduce-scatter is
    launched (ZeRO-3 frees the unit's gathered parameters there: backward is done with them).
    """

    every_microbatch = True
    max_in_flight = 1  # the transient memory: at most one full bucket in flight, plus the one being filled

    def __init__(self, comm: Comm, transient: PeakBytes, reduce_dtype: torch.dtype = torch.float32,
                 after_launch: Callable[[Bucket], None] | None = None, divisor: int | None = None) -> None:
        self.comm = comm
        self.transient = transient
        self.reduce_dtype = reduce_dtype
        self.after_launch = after_launch
        self.divisor = divisor or comm.size  # the sum over the group is divided by it (default: the average)

    def setup(self, bucket: Bucket) -> None:
        start, stop = bucket.shard_range(self.comm.rank, self.comm.size)
        bucket.grad_shard = torch.zeros(stop - start, dtype=self.reduce_dtype, device=bucket.params[0].device)

    def buffer(self, bucket: Bucket) -> torch.Tensor:
        if bucket.grad is None:
            self.transient.add(bucket.allocate_grad(self.reduce_dtype).nbytes)
        return bucket.grad

    def launch(self, bucket: Bucket) -> Handle:
        self.buffer(bucket)  # a bucket none of whose parameters got a gradient this backward sends zeros
        handle = _reduce_scatter(self.comm, bucket)
        if self.after_launch is not None:
            self.after_launch(bucket)
        return handle

    def complete(self, bucket: Bucket, result: torch.Tensor) -> None:
        bucket.grad_shard.add_(result.div_(self.divisor))  # micro-batches add up in the shard
        self.transient.sub(bucket.grad.nbytes)
        bucket.grad, bucket.grad_views = None, []

    def reset(self, bucket: Bucket) -> None:
        bucket.grad_shard.zero_()

    def publish(self, bucket: Bucket) -> None:
        """Nothing: the optimizer reads the shards."""
