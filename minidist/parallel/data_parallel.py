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

Everything is sent through a `minidist.comm.Comm` over the group of ranks that hold the same parameters (the
"dp_cp" group of a Topology), so the ledger sees every byte and the wrapper composes with tensor and pipeline
parallelism: each tp shard / pp stage averages only with its own replicas.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from minidist.comm import Comm, Handle

DEFAULT_BUCKET_BYTES = 4 * 2**20  # 4 MiB: a few buckets for the small preset, one or two for tiny

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
    `padded`, a multiple of `pad_to` (ZeRO pads to the group size so that every rank owns an equal shard).
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
        self.grad: torch.Tensor | None = None  # the flat gradient buffer (allocated by the owner)
        self.grad_views: list[torch.Tensor] = []  # each parameter's view of it
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

    def __repr__(self) -> str:
        return f"Bucket({self.index}: {len(self.params)} params, {self.numel} elements, {self.names[0]}..)"


def assign_buckets(named_params: Sequence[tuple[str, nn.Parameter]], bucket_bytes: int, element_size: int = 4,
                   pad_to: int = 1) -> list[Bucket]:
    """Group parameters into buckets of at most `bucket_bytes` (a larger parameter gets a bucket of its own).

    Parameters are taken in reverse registration order: backward produces gradients roughly from the last layer to
    the first, so the first bucket fills first and its all-reduce can start while earlier layers still compute.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    groups: list[list[tuple[str, nn.Parameter]]] = [[]]
    size = 0
    for name, param in reversed(list(named_params)):
        nbytes = param.numel() * element_size
        if groups[-1] and size + nbytes > bucket_bytes:
            groups.append([])
            size = 0
        groups[-1].append((name, param))
        size += nbytes
    return [Bucket(i, g, pad_to) for i, g in enumerate(groups) if g]


# ---------------------------------------------------------------------------------------------------------------
# Timeline: when gradients became ready and when each bucket's collective started and finished
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Timeline:
    """Events (kind, seconds since `t0`, label) recorded during a step; chapter 07 draws them.

    kinds: "grad" (a parameter's gradient is accumulated; label = name), "launch" / "done" (a bucket's collective
    started / completed, label = bucket index), "backward_end", "wait_end" (finish_grad_sync returned), and whatever
    the caller adds with `mark` (e.g. "forward_start").
    """

    t0: float = field(default_factory=time.perf_counter)
    events: list[tuple[str, float, object]] = field(default_factory=list)

    def mark(self, kind: str, label: object = None) -> None:
        # list.append is atomic under the GIL: "done" events arrive from the communication thread.
        self.events.append((kind, time.perf_counter() - self.t0, label))

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.events.clear()


def _on_completion(handle: Handle, callback: Callable[[], None]) -> Callable[[], None] | None:
    """Arrange for `callback()` when the collective behind `handle` completes (for the timeline only).

    Returns None when torch will call it (a future on the communication thread), else the callback itself, to be
    called after `handle.wait()`. gloo's reduce-scatter has no future: it runs inside wait(), so the moment wait
    returns is its true completion (and waiting on it from another thread would run it twice).
    """
    work = getattr(handle, "_work", None)  # Comm's Handle wraps the torch Work of a real collective
    if work is None:
        callback()
        return None
    try:
        work.get_future().then(lambda _: callback())
        return None
    except RuntimeError:  # "Work::getFuture not implemented"
        return callback


# ---------------------------------------------------------------------------------------------------------------
# 2 and 3. Bucketed, overlapped data parallelism
# ---------------------------------------------------------------------------------------------------------------


class DataParallel:
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
    """

    # Subclasses (ZeRO) reduce every micro-batch; plain data parallelism communicates on the last one only.
    sync_every_microbatch = False

    def __init__(self, model: nn.Module, comm: Comm, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 overlap: bool = True, reduce_dtype: torch.dtype = torch.float32, timeline: Timeline | None = None,
                 buckets: list[Bucket] | None = None) -> None:
        self.model = model
        self.comm = comm
        self.overlap = overlap
        self.reduce_dtype = reduce_dtype
        self.timeline = timeline
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no parameters that require gradients")
        element_size = torch.empty((), dtype=reduce_dtype).element_size()
        # Padding every bucket to a multiple of the group size keeps the ring's chunks equal (and the ledger's
        # bytes exactly 2(N-1)/N of the bucket); the few zeros cost nothing.
        self.buckets = buckets if buckets is not None else assign_buckets(named, bucket_bytes, element_size,
                                                                          pad_to=comm.size)
        self._slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        missing = [n for n, p in named if id(p) not in self._slot]
        if missing:
            raise ValueError(f"parameters {missing[:3]} are in no bucket; every trainable parameter must be")
        self._allocate_grad_buffers()
        self._sync = True
        self._in_backward = False
        self._pending = False  # gradients accumulated since the last reduction
        self._stale = False  # gradients of the last step are published; the next forward clears them
        self._next_launch = 0
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for _, p in named]
        self._hooks.append(model.register_forward_pre_hook(self._on_forward))

    # -- buffers (ZeRO overrides these) -----------------------------------------------------------------------------

    def _allocate_grad_buffers(self) -> None:
        for bucket in self.buckets:
            bucket.grad = torch.zeros(bucket.padded, dtype=self.reduce_dtype, device=bucket.params[0].device)
            bucket.grad_views = bucket.views(bucket.grad)

    def _grad_buffer(self, bucket: Bucket) -> torch.Tensor:
        return bucket.grad

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
        self._publish()
        self._stale = True
        if self.timeline is not None:
            self.timeline.mark("wait_end")

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
            if bucket.grad is not None:
                bucket.grad.zero_()
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
        self._grad_buffer(bucket)
        view = bucket.grad_views[i]
        view.add_(param.grad)  # accumulate (and cast to reduce_dtype): the bucket is the gradient's only home
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
        if self._syncing() and self.overlap:
            self._launch_all()  # parameters that got no gradient (unused this step) count as zero
        for bucket in self.buckets:
            bucket.ready = 0
        self._after_backward()

    def _after_backward(self) -> None:
        """Hook for subclasses: ZeRO-2/3 finish their reduce-scatters after every backward."""

    def _syncing(self) -> bool:
        return self._sync or self.sync_every_microbatch

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
        bucket.handle = self._start_collective(bucket)
        if self.timeline is not None:
            self.timeline.mark("launch", bucket.index)
            bucket.after_wait = _on_completion(bucket.handle, lambda: self.timeline.mark("done", bucket.index))

    def _start_collective(self, bucket: Bucket) -> Handle:
        return self.comm.all_reduce(self._grad_buffer(bucket), op="avg", async_op=True)

    def _wait(self, bucket: Bucket) -> None:
        bucket.handle.wait()
        bucket.handle = None
        if bucket.after_wait is not None:
            bucket.after_wait()
            bucket.after_wait = None

    def _complete(self, bucket: Bucket) -> None:
        if bucket.handle is not None:
            self._wait(bucket)

    def _complete_all(self) -> None:
        for bucket in self.buckets:
            self._complete(bucket)
        self._next_launch = 0
        self._pending = False

    def _publish(self) -> None:
        for bucket in self.buckets:
            for param, view in zip(bucket.params, bucket.grad_views):
                param.main_grad = view
                param.grad = view if view.dtype == param.dtype else view.to(param.dtype)
