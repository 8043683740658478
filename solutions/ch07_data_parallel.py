"""Chapter 07 exercises, answered: bucketed, overlapped gradient all-reduce with accumulation; ZeRO's shard pieces.

`bucketed_all_reduce` is the notebook's `BucketedDP` grown up by one step: gradients of several micro-batches add up
in the fp32 buckets, and only the last backward of a step communicates (Li et al. 2020, "PyTorch Distributed:
Experiences on Accelerating Data Parallel Training", §3.2.2-3.2.4). `zero_owned_pieces` is the bookkeeping behind
ZeRO's sharded optimizer (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", §5.1): which elements of which parameters a rank updates.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


def bucketed_all_reduce(model: nn.Module, bucket_bytes: int, microbatches: int = 1,
                        group: dist.ProcessGroup | None = None) -> Callable[[], None]:
    """Attach bucketed, overlapped gradient averaging to `model`; return `finish()` (see exercises/ch07)."""
    world = dist.get_world_size(group)
    # Buckets: parameters in reverse order (backward produces the last layers' gradients first), capped in fp32 bytes.
    buckets: list[list[nn.Parameter]] = [[]]
    size = 0
    for param in reversed(list(model.parameters())):
        if buckets[-1] and size + 4 * param.numel() > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(param)
        size += 4 * param.numel()
    slot = {}
    for b, bucket in enumerate(buckets):
        offset = 0
        for param in bucket:
            slot[param] = (b, offset)
            offset += param.numel()
    flats = [torch.zeros(sum(p.numel() for p in bucket)) for bucket in buckets]
    state = {"arrived": [0] * len(buckets), "next": 0, "work": [None] * len(buckets)}

    def ready(b: int) -> bool:  # every parameter of bucket b has had its gradient of the step's last backward
        return state["arrived"][b] == microbatches * len(buckets[b])

    def hook(param: nn.Parameter) -> None:
        b, offset = slot[param]
        # Accumulate in the fp32 bucket and leave .grad empty: the bucket is the gradient's only home.
        flats[b][offset:offset + param.numel()] += param.grad.detach().flatten().float()
        param.grad = None
        state["arrived"][b] += 1
        # Launch strictly in bucket order (every rank must issue its collectives in the same order).
        while state["next"] < len(buckets) and ready(state["next"]):
            i = state["next"]
            state["work"][i] = dist.all_reduce(flats[i], group=group, async_op=True)
            state["next"] += 1

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(hook)

    def finish() -> None:
        for b, bucket in enumerate(buckets):
            state["work"][b].wait()
            for param in bucket:
                _, offset = slot[param]
                param.grad = (flats[b][offset:offset + param.numel()] / world).view_as(param).to(param.dtype)
            flats[b].zero_()
        state["arrived"], state["next"], state["work"] = [0] * len(buckets), 0, [None] * len(buckets)

    return finish


def zero_owned_pieces(numels: list[int], world: int, rank: int) -> list[tuple[int, int, int, int]]:
    """The pieces of the parameters that rank `rank` of `world` owns in ZeRO's padded flat layout (see exercises)."""
    total = sum(numels)
    padded = -(-total // world) * world
    size = padded // world
    lo, hi = rank * size, (rank + 1) * size
    pieces = []
    offset = 0
    for i, n in enumerate(numels):
        start, stop = max(lo, offset), min(hi, offset + n)  # the overlap of [offset, offset + n) with [lo, hi)
        if start < stop:
            pieces.append((i, start - offset, stop - offset, start - lo))
        offset += n
    return pieces
