"""Data parallelism from scratch: every rank holds the whole model, sees 1/N of the batch, and averages gradients.

Why averaging is exact. The loss of a global batch of B rows is the mean of the row losses; split the rows into N
equal shards and it is the mean of the N shard means, so its gradient is the mean of the N shard gradients:

    ∇ (1/B) Σ_b ℓ_b = (1/N) Σ_r ∇ [(N/B) Σ_{b ∈ shard r} ℓ_b]

Each rank computes the gradient of its own shard's mean loss; an all-reduce (sum) divided by N gives every rank
the full-batch gradient, and identical optimizer steps keep the replicas identical. With M micro-batches per rank
the same argument one level down says: scale each micro-batch loss by 1/M and let the gradients add up.

Three versions, in the order chapter 07 builds them:

1. `average_gradients`: after backward, one blocking all-reduce per parameter (the naive version: many small
   messages, each paying the latency α, and nothing overlaps with compute).
2. `DataParallel(overlap=False)`: gradients are copied into a few flat fp32 buckets; one all-reduce per bucket
   after backward (few large messages, Li et al. 2020, "PyTorch Distributed", §3.2.2; overlap: §3.2.3).
3. `DataParallel(overlap=True)`: a bucket's all-reduce starts from a gradient hook the moment its last gradient is
   ready, so communication runs while backward computes the remaining gradients; `finish_grad_sync()` waits for
   all of them before the optimizer step.

Gradient accumulation: inside `no_sync()` the hooks only accumulate into the buckets; the last micro-batch
(outside `no_sync()`) communicates. fp32 reduction: buckets are `reduce_dtype` (fp32 by default) whatever dtype
the gradients arrive in, so bf16 gradients are summed in fp32 over micro-batches and ranks and rounded once.

What happens to a full bucket is a small strategy object (`GradReduction`): plain data parallelism all-reduces it
(`AllReduceGrads`); ZeRO reduce-scatters it instead (minidist/parallel/dp/zero_grads.py). The hooks, the bucket order
and the overlap are the same for all of them, in `DataParallel`.

Everything is sent through a `minidist.comm.communicator.Comm` over the group of ranks that hold the same parameters
(the "dp_cp" group of a Topology), so the ledger sees every byte and the wrapper composes with tensor and pipeline
parallelism: each tp shard / pp stage averages only with its own replicas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import torch
from torch import nn

from minidist.comm.communicator import Comm, Handle
from minidist.parallel.dp.timeline import Timeline, on_completion
from minidist.parallel.grad_sync import GradSync

CPU_BUCKET_BYTES = 4 * 2**20  # 4 MiB: a few buckets for the small preset, one or two for tiny (chapter 07's figures)
CUDA_BUCKET_BYTES = 25 * 2**20  # DDP's default: ~40 NCCL calls a step at 1B parameters in fp32, not ~250


def default_bucket_bytes(device: torch.device) -> int:
    """The bucket cap when none is given: DDP's 25 MiB on CUDA, where each NCCL call costs a launch and a few µs of
    latency, and 4 MiB elsewhere (a CPU run's buckets, and the chapter's figures, as they always were)."""
    return CUDA_BUCKET_BYTES if torch.device(device).type == "cuda" else CPU_BUCKET_BYTES

# ---------------------------------------------------------------------------------------------------------------
# Splitting the batch
# ---------------------------------------------------------------------------------------------------------------


def check_batch_split(global_batch: int, dp: int, microbatches: int = 1) -> int:
    """Rows per micro-batch on one rank; a one-line ValueError unless dp·microbatches divides the global batch."""
    for name, value in (("global_batch", global_batch), ("dp", dp), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if global_batch % (dp * microbatches):
        raise ValueError(f"global batch {global_batch} does not split into dp={dp} ranks x {microbatches} "
                         f"micro-batches; use a multiple of {dp * microbatches}")
    return global_batch // (dp * microbatches)


def split_batch(inputs: torch.Tensor, targets: torch.Tensor, rank: int, dp: int,
                microbatches: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank `rank`'s contiguous rows of the global batch, cut into `microbatches` equal (inputs, targets) pieces."""
    rows = check_batch_split(inputs.shape[0], dp, microbatches)
    mine = slice(rank * rows * microbatches, (rank + 1) * rows * microbatches)
    return list(zip(inputs[mine].split(rows), targets[mine].split(rows)))


# ---------------------------------------------------------------------------------------------------------------
# 1. Naive
# ---------------------------------------------------------------------------------------------------------------


def average_gradients(model: nn.Module, comm: Comm) -> None:
    """After backward: all-reduce every parameter's gradient, one blocking call each, and divide by the group size."""
    for param in model.parameters():
        if param.grad is not None:
            comm.all_reduce(param.grad, op="avg")


# ---------------------------------------------------------------------------------------------------------------
# Buckets
# ---------------------------------------------------------------------------------------------------------------


class Bucket:
    """A few parameters whose gradients live side by side in one flat buffer and travel in one collective.

    Parameter i occupies [offsets[i], offsets[i] + numels[i]) of the flat layout; the layout is padded with zeros to
    `padded`, a multiple of `pad_to` (the group size, so that every rank owns an equal slice). Rank r of N owns
    [r·padded/N, (r+1)·padded/N): ZeRO keeps only that slice of some of the tensors below (None where unused).
    """

    def __init__(self, index: int, named_params: Sequence[tuple[str, nn.Parameter]], pad_to: int = 1) -> None:
        if not named_params:
            raise ValueError("a bucket needs at least one parameter")
        self.index = index
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(self.params))]
        self.numel = sum(self.numels)
        self.padded = -(-self.numel // pad_to) * pad_to
        # Gradients. `grad` is the full flat buffer the hooks accumulate into (ZeRO-2/3: only while in flight).
        self.grad: torch.Tensor | None = None
        self.grad_views: list[torch.Tensor] = []  # each parameter's view of `grad`
        self.grad_shard: torch.Tensor | None = None  # ZeRO: this rank's slice of the averaged gradient
        # Parameters. Plain data parallelism leaves them where they are; ZeRO moves them here.
        self.param_flat: torch.Tensor | None = None  # ZeRO-1/2: the parameters, as views of this flat buffer
        self.param_shard: torch.Tensor | None = None  # ZeRO: this rank's slice, what its optimizer updates
        # The collective of the current step.
        self.ready = 0  # gradients that arrived during the current backward
        self.handle: Handle | None = None
        self.after_wait: Callable[[], None] | None = None  # a timeline callback to run once the handle is waited

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's slice of a flat buffer laid out like this bucket, shaped like the parameter."""
        return [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def shard_range(self, rank: int, world: int) -> tuple[int, int]:
        """[start, stop) of the flat layout that rank `rank` of `world` owns (padded must divide by world)."""
        size = self.padded // world
        return rank * size, (rank + 1) * size

    def allocate_grad(self, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed full gradient buffer, and the parameters' views of it."""
        self.grad = torch.zeros(self.padded, dtype=dtype, device=self.params[0].device)
        self.grad_views = self.views(self.grad)
        return self.grad

    def __repr__(self) -> str:
        return f"Bucket({self.index}: {len(self.params)} params, {self.numel} elements, {self.names[0]}..)"


def assign_buckets(named_params: Sequence[tuple[str, nn.Parameter]], bucket_bytes: int, element_size: int = 4,
                   pad_to: int = 1, alone: Callable[[nn.Parameter], bool] = lambda p: False) -> list[Bucket]:
    """Group parameters into buckets of at most `bucket_bytes` (a larger parameter, or one `alone` says, gets a
    bucket of its own).

    Parameters are taken in reverse registration order: backward produces gradients roughly from the last layer to
    the first, so the first bucket fills first and its all-reduce can start while earlier layers still compute.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    groups: list[list[tuple[str, nn.Parameter]]] = [[]]
    size = 0
    for name, param in reversed(list(named_params)):
        nbytes = param.numel() * element_size
        if groups[-1] and (size + nbytes > bucket_bytes or alone(param)):
            groups.append([])
            size = 0
        groups[-1].append((name, param))
        size += nbytes
        if alone(param):
            size = bucket_bytes  # the next parameter starts a new bucket
    return [Bucket(i, g, pad_to) for i, g in enumerate(groups) if g]


# ---------------------------------------------------------------------------------------------------------------
# What to do with a full bucket: the reduction strategy
# ---------------------------------------------------------------------------------------------------------------


class GradReduction(Protocol):
    """How `DataParallel` reduces a bucket: where its gradient lives, what to launch, what to do on completion."""

    every_microbatch: bool  # reduce after every backward, `no_sync` or not (the full buffer cannot wait)
    max_in_flight: int | None  # at most this many buckets in flight (their full buffers are alive); None: any

    def setup(self, bucket: Bucket) -> None:
        """Allocate what lives as long as the wrapper (once per bucket, at construction)."""

    def buffer(self, bucket: Bucket) -> torch.Tensor:
        """The full flat buffer that gradients accumulate into (allocated here if it lives only per backward)."""

    def launch(self, bucket: Bucket) -> Handle:
        """Start the bucket's collective, asynchronously."""

    def complete(self, bucket: Bucket, result: torch.Tensor) -> None:
        """The collective finished with `result` (its output tensor): put the reduced gradient where it lives."""

    def reset(self, bucket: Bucket) -> None:
        """Zero the accumulated gradient for a new step."""

    def publish(self, bucket: Bucket) -> None:
        """After the last bucket completed: show the optimizer the reduced gradient."""


class AllReduceGrads:
    """Plain data parallelism: a full `reduce_dtype` bucket per group of parameters, kept for the whole run, and one
    all-reduce per bucket per step: the sum over the group, divided by `divisor` (default the group size: the
    average; expert parallelism sums expert gradients over edp and divides by dp·cp). Afterwards every parameter's
    `.grad` is its view of the bucket."""

    every_microbatch = False
    max_in_flight = None

    def __init__(self, comm: Comm, reduce_dtype: torch.dtype = torch.float32, divisor: int | None = None) -> None:
        self.comm = comm
        self.reduce_dtype = reduce_dtype
        self.divisor = divisor or comm.size

    def setup(self, bucket: Bucket) -> None:
        bucket.allocate_grad(self.reduce_dtype)

    def buffer(self, bucket: Bucket) -> torch.Tensor:
        return bucket.grad

    def launch(self, bucket: Bucket) -> Handle:
        return self.comm.all_reduce(bucket.grad, op="sum", async_op=True)

    def complete(self, bucket: Bucket, result: torch.Tensor) -> None:
        bucket.grad.div_(self.divisor)  # the all-reduce summed the bucket in place

    def reset(self, bucket: Bucket) -> None:
        bucket.grad.zero_()

    def publish(self, bucket: Bucket) -> None:
        for param, view in zip(bucket.params, bucket.grad_views):
            param.main_grad = view
            param.grad = view if view.dtype == param.dtype else view.to(param.dtype)


# ---------------------------------------------------------------------------------------------------------------
# 2 and 3. Bucketed, overlapped data parallelism
# ---------------------------------------------------------------------------------------------------------------


class DataParallel(GradSync):
    """Average gradients over `comm`'s group with bucketed (optionally overlapped) all-reduces.

    The model stays a plain module: this object registers hooks on it. Use:

        dp = DataParallel(model, comm)
        for i, (x, y) in enumerate(micro_batches):
            with dp.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                (lm_loss(model(x), y) / len(micro_batches)).backward()
        dp.finish_grad_sync()        # every p.grad now holds the average over ranks
        optimizer.step()

    After `finish_grad_sync()`, `p.grad` is a view of the fp32 bucket (p.grad = the bucket cast to p's dtype when the
    parameter is not fp32; `p.main_grad` is always the fp32 view). The next forward with gradients enabled starts a
    fresh accumulation (gradients and buckets are cleared), so `optimizer.zero_grad()` is optional.

    `reduction` replaces the all-reduce (ZeRO passes a reduce-scatter, and its own `buckets`). `params`: the
    (name, parameter) pairs of `model` this object reduces (default: all; expert parallelism reduces its experts
    over another group). It is a `GradSync` (minidist/parallel/grad_sync.py): what `ParallelModel` calls.
    """

    def __init__(self, model: nn.Module, comm: Comm, *, bucket_bytes: int | None = None,
                 overlap: bool = True, reduce_dtype: torch.dtype = torch.float32, timeline: Timeline | None = None,
                 buckets: list[Bucket] | None = None, reduction: GradReduction | None = None,
                 params: Sequence[tuple[str, nn.Parameter]] | None = None) -> None:
        self.model = model
        self.comm = comm
        self.overlap = overlap
        self.timeline = timeline
        self.reduction = reduction if reduction is not None else AllReduceGrads(comm, reduce_dtype)
        named = [(n, p) for n, p in (params if params is not None else model.named_parameters()) if p.requires_grad]
        if not named:
            raise ValueError("the model has no parameters that require gradients")
        self.named = named
        element_size = torch.empty((), dtype=reduce_dtype).element_size()
        # Padding every bucket to a multiple of the group size keeps the ring's chunks equal (and the ledger's
        # bytes exactly 2(N-1)/N of the bucket); the few zeros cost nothing.
        if buckets is None:
            bucket_bytes = default_bucket_bytes(named[0][1].device) if bucket_bytes is None else bucket_bytes
            buckets = assign_buckets(named, bucket_bytes, element_size, pad_to=comm.size)
        self.buckets = buckets
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        missing = [n for n, p in named if id(p) not in self._slot]
        if missing:
            raise ValueError(f"parameters {missing[:3]} are in no bucket; every trainable parameter must be")
        for bucket in self.buckets:
            self.reduction.setup(bucket)
        self._sync = True
        self._in_backward = False
        self._pending = False  # gradients accumulated since the last reduction
        self._stale = False  # gradients of the last step are published; the next forward clears them
        self._next_launch = 0
        self._in_flight: list[Bucket] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]
        self._hooks.append(model.register_forward_pre_hook(self._on_forward))

    # -- public API -----------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate gradients locally (all micro-batches but the last)."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def finish_grad_sync(self) -> None:
        """Launch what has not been launched, wait for every bucket, and publish the averaged gradients."""
        if self._stale and not self._pending:
            return  # already done for this step
        if self._pending:
            self._launch_all()
        self._complete_all()
        for bucket in self.buckets:
            self.reduction.publish(bucket)
        self._stale = True
        if self.timeline is not None:
            self.timeline.mark("wait_end")

    def zero_grad(self) -> None:
        """Drop this step's gradients now (the next forward would anyway), after finishing its collectives."""
        self.finish_grad_sync()
        self._reset()

    def comms(self) -> list[Comm]:
        return [self.comm]

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The flat gradient buckets (and ZeRO's gradient shards) besides the parameters' `.grad`."""
        grads = [t for b in self.buckets for t in (b.grad, b.grad_shard) if t is not None]
        return {"params": [], "grads": grads}

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    # -- hooks ----------------------------------------------------------------------------------------------------

    def _on_forward(self, module: nn.Module, args: tuple) -> None:
        if self._stale and torch.is_grad_enabled():
            self._reset()

    def _reset(self) -> None:
        """Start a fresh accumulation: drop the published gradients and zero the buffers."""
        for bucket in self.buckets:
            for param in bucket.params:
                param.grad = None
            self.reduction.reset(bucket)
        self._stale = False

    def _on_grad(self, param: nn.Parameter) -> None:
        if self._stale:  # the forward bypassed our pre-hook (model.forward(...) instead of model(...))
            if param.grad is not None and param.grad is getattr(param, "main_grad", None):
                raise RuntimeError("a new backward accumulated into last step's averaged gradients: call the model "
                                   "as model(x) (its forward hook starts a fresh step) or zero_grad() first")
            grad = param.grad
            self._reset()
            param.grad = grad
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
        self._pending = True
        bucket, i = self._slot[id(param)]
        self.reduction.buffer(bucket)
        bucket.grad_views[i].add_(param.grad)  # accumulate (and cast): the bucket is the gradient's only home
        param.grad = None
        if self.timeline is not None:
            self.timeline.mark("grad", bucket.names[i])
        bucket.ready += 1
        if bucket.ready == len(bucket.params) and self._syncing() and self.overlap:
            self._launch_in_order()

    def _on_backward_end(self) -> None:
        self._in_backward = False
        if self.timeline is not None:
            self.timeline.mark("backward_end")
        for bucket in self.buckets:
            bucket.ready = 0
        if self.reduction.every_microbatch:  # reduced now, overlapped or not: the full buckets do not outlive it
            self._launch_all()
            self._complete_all()
        elif self._sync and self.overlap:
            self._launch_all()  # parameters that got no gradient (unused this step) count as zero

    def _syncing(self) -> bool:
        return self._sync or self.reduction.every_microbatch

    # -- launching and completing collectives ---------------------------------------------------------------------

    def _launch_in_order(self) -> None:
        # Every rank must issue the collectives in the same order; buckets are launched strictly by index.
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.ready < len(bucket.params):
                return
            self._launch(bucket)
            self._next_launch += 1

    def _launch_all(self) -> None:
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.handle = self.reduction.launch(bucket)
        if self.timeline is not None:
            self.timeline.mark("launch", bucket.index)
            bucket.after_wait = on_completion(bucket.handle, lambda: self.timeline.mark("done", bucket.index))
        # A bound on the buckets in flight bounds their memory. (gloo runs a reduce-scatter inside wait(), so
        # without it every bucket would stay alive until backward ends.)
        self._in_flight.append(bucket)
        limit = self.reduction.max_in_flight
        while limit is not None and len(self._in_flight) > limit:
            self._complete(self._in_flight.pop(0))

    def _complete(self, bucket: Bucket) -> None:
        if bucket.handle is None:
            return
        result = bucket.handle.wait()
        bucket.handle = None
        if bucket.after_wait is not None:
            bucket.after_wait()
            bucket.after_wait = None
        self.reduction.complete(bucket, result)

    def _complete_all(self) -> None:
        for bucket in self.buckets:
            self._complete(bucket)
        self._in_flight.clear()
        self._next_launch = 0
        self._pending = False
