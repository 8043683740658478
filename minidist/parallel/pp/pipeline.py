"""Pipeline parallelism (chapter 09): cut a built model into stages and run any schedule on them.

Three pieces:

1. `partition_model` keeps the part of a full `Transformer` that one pipeline rank runs: its chunks of consecutive
   blocks (p·v chunks, even by layers; rank r holds chunks r, r+p, r+2p, ...), the embedding with chunk 0, the
   final norm, head and loss with the last chunk. The modules are the model's own, under the model's own names
   ("blocks.5.attn.wq.weight"), so optimizers, checkpoints and parity tests compare parameters by name, and the
   model's own forward runs them (over a chunk's blocks, with or without the embedding and the head).
2. `PipelineRunner` executes one rank's list of actions (any schedule of `schedules` or `zero_bubble`; it does not
   know which). Activations and gradients travel through `minidist.comm.communicator` (the ledger sees every byte)
   in the steps `p2p.p2p_program` plans, an order NCCL's tagless, in-order matching cannot deadlock or mix up. The
   last chunk scores the SUM of its token losses scaled by the caller's `loss_scale` (replicas / tokens counted in
   the global batch): the gradient of the mean over every counted token, whatever each micro-batch counts. A
   micro-batch's saved activations are released by its backward (its W under a zero-bubble schedule), which is what
   makes 1F1B's memory smaller than AFAB's; `measure_memory=True` counts those bytes with saved-tensor hooks.
3. `validate_pipeline` checks a layout before any process group exists, with one-line errors.

Every stage recomputes RoPE's cos/sin from the model's rotary buffers for the positions of the micro-batch: only
hidden states cross the wire.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from minidist.comm.communicator import Comm
from minidist.memory import PeakSavedBytes
from minidist.model import ModelConfig, Transformer, lm_loss
from minidist.model.documents import Docs, Documents
from minidist.parallel.placement import placement_of
from minidist.parallel.pp.nccl_model import Post, Wait
from minidist.parallel.pp.p2p import InFlight, Message, Planned, due_by_action, message_of, p2p_program
from minidist.parallel.pp.schedules import (
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    V_SCHEDULES,
    Action,
    B,
    Event,
    F,
    W,
    forward_only,
    rank_chunks,
)
from minidist.parallel.pp.split_backward import backward_input, backward_weight
from minidist.parallel.pp.zero_bubble import (
    build_any_schedule,
    check_any_schedule_args,
    chunks_per_rank,
    fused_backwards,
)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, targets) -> Σ token losses, fp32
sum_lm_loss: LossFn = functools.partial(lm_loss, reduction="sum")
Positions = list[torch.Tensor] | None  # per micro-batch (None: 0..T−1)

# ---------------------------------------------------------------------------------------------------------------
# Validation and partitioning
# ---------------------------------------------------------------------------------------------------------------


def validate_pipeline(cfg: ModelConfig, pp: int, microbatches: int, virtual_stages: int = 1,
                      schedule: str = "1f1b", batch_size: int | None = None) -> None:
    """Raise a one-line ValueError unless this model can be pipelined this way. Needs no process group.

    `batch_size` (optional) is the number of sequences one pipeline replica processes per step (global batch / dp);
    it must split into `microbatches` equal micro-batches.
    """
    check_any_schedule_args(schedule, pp, microbatches, virtual_stages)
    check_partition(cfg, pp, chunks_per_rank(schedule, virtual_stages))
    if batch_size is not None and batch_size % microbatches:
        fits = [d for d in range(1, batch_size + 1) if batch_size % d == 0]
        raise ValueError(f"the batch of {batch_size} sequences per pipeline does not split into "
                         f"microbatches={microbatches}; pick microbatches from {fits}")


def check_partition(cfg: ModelConfig, pp: int, virtual_stages: int = 1) -> None:
    """One-line ValueError unless the model's layers split into pp·virtual_stages chunks this pipeline supports."""
    n_chunks = pp * virtual_stages
    if cfg.n_layers < n_chunks:
        what = f"pp={pp}" if virtual_stages == 1 else f"pp*virtual_stages={pp}*{virtual_stages}={n_chunks}"
        raise ValueError(f"n_layers={cfg.n_layers} is fewer than the {n_chunks} pipeline chunks ({what}); "
                         f"every chunk needs at least one layer")
    if virtual_stages > 1 and cfg.n_layers % n_chunks:
        fits = [v for v in range(1, cfg.n_layers // pp + 1) if cfg.n_layers % (pp * v) == 0]
        raise ValueError(f"virtual_stages={virtual_stages} does not divide the layers per stage "
                         f"(n_layers={cfg.n_layers} / pp={pp}); virtual_stages in {fits} would fit")


def chunk_layers(n_layers: int, pp: int, virtual_stages: int = 1) -> list[range]:
    """The layers of each of the p·v chunks: consecutive, as even as possible (earlier chunks get the extra ones,
    since the last chunk also runs the head and the loss)."""
    n = pp * virtual_stages
    base, extra = divmod(n_layers, n)
    bounds = [0]
    for c in range(n):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return [range(bounds[c], bounds[c + 1]) for c in range(n)]


class StageModule(Transformer):
    """The model as one pipeline rank holds it: the same modules under the same names, with the blocks of the other
    ranks' chunks replaced by None (and the embedding, final norm and head where they are not on this rank).

    It runs its parts through `Transformer.forward`'s keywords, so there is one forward in the package: a chunk is
    `stage(x, positions, blocks=stage.layers[chunk], embed=<first chunk>, head=<last chunk>)`.
    """

    def __init__(self, model: Transformer, pp_rank: int, pp: int, virtual_stages: int = 1,
                 loss_fn: LossFn = sum_lm_loss, v_shape: bool = False) -> None:
        nn.Module.__init__(self)  # adopt the built (maybe tensor-parallel) model's modules; build none
        self.cfg = model.cfg
        self.pp, self.pp_rank, self.virtual_stages, self.v_shape = pp, pp_rank, virtual_stages, v_shape
        self.n_chunks = pp * virtual_stages
        self.chunks = rank_chunks(pp_rank, pp, virtual_stages, v_shape)
        layers = chunk_layers(model.cfg.n_layers, pp, virtual_stages)
        self.layers = {c: list(layers[c]) for c in self.chunks}
        self.has_first, self.has_last = 0 in self.chunks, self.n_chunks - 1 in self.chunks
        mine = {i for c in self.chunks for i in self.layers[c]}
        # A tied head's weight is the embedding's: the last stage keeps it under its one-process name (the
        # embedding module is never called there); the two copies are kept equal by minidist.parallel.pp.tied.
        # Under the V placement rank 0 holds both chunks: one copy, both uses' gradients summed by autograd.
        tied = self.has_last and model.lm_head.weight is model.tok_emb.weight
        self.tok_emb = model.tok_emb if self.has_first or tied else None
        self.pos_emb = model.pos_emb if self.has_first else None
        self.rotary = model.rotary  # buffers only: every stage turns positions into cos/sin itself
        self.blocks = nn.ModuleList(block if i in mine else None for i, block in enumerate(model.blocks))
        self.norm = model.norm if self.has_last else None
        self.lm_head = model.lm_head if self.has_last else None
        self.loss_fn = loss_fn
        for param in self.parameters():  # the record every reader of the layout uses (norms, checkpoints)
            param.placement = dataclasses.replace(placement_of(param), stage=pp_rank)

    def forward_chunk(self, chunk: int, x: torch.Tensor, positions: torch.Tensor | None = None,
                      docs: torch.Tensor | Documents | None = None) -> torch.Tensor:
        """Chunk 0 takes tokens [B, T], the others hidden states [B, T, d]; the last returns logits."""
        if chunk not in self.layers:
            raise ValueError(f"chunk {chunk} is not on pipeline rank {self.pp_rank} (it holds {self.chunks})")
        return self(x, positions, docs=docs, blocks=self.layers[chunk], embed=chunk == 0,
                    head=chunk == self.n_chunks - 1)


def partition_model(model: Transformer, pp_rank: int, pp: int, virtual_stages: int = 1,
                    loss_fn: LossFn = sum_lm_loss, schedule: str = "1f1b") -> StageModule:
    """This rank's `StageModule`. Build (and tensor-parallelize) the full model first; the rest is dropped.
    `loss_fn(logits, targets)` is what the last chunk scores: the SUM of the token losses, in fp32. A V schedule
    (zbv) implies two chunks per rank, placed in a V."""
    v_shape = schedule in V_SCHEDULES
    virtual_stages = chunks_per_rank(schedule, virtual_stages)
    check_partition(model.cfg, pp, virtual_stages)
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} is outside 0..{pp - 1}")
    return StageModule(model, pp_rank, pp, virtual_stages, loss_fn, v_shape)


# ---------------------------------------------------------------------------------------------------------------
# The executor
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class StepStats:
    # [2] on the compute device: Σ of the step's token losses (the same on every pipeline rank) and the MoE balancing
    # losses (summed over stages, mean over micro-batches); the trainer reads them on logging steps, `loss` now.
    totals: torch.Tensor | None = None
    events: list[Event] = field(default_factory=list)  # this rank's actions, time.perf_counter() start/end
    peak_activation_bytes: int = 0  # most bytes saved for backward alive at once (measure_memory=True)
    peak_in_flight: int = 0  # most (micro-batch, chunk) forwards awaiting their backward at once

    @property
    def loss(self) -> float:
        return self.totals[0].item() if self.totals is not None else 0.0

    @property
    def aux_loss(self) -> float:
        return self.totals[1].item() if self.totals is not None else 0.0


class _SavedBytes:
    """Counts the bytes of the tensors autograd saves for backward, per forward, excluding parameters
    (`memory.PeakSavedBytes`); `seen`: the storages the last forward saved and still holds, with their bytes."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params, self.seen = list(params), {}

    @contextlib.contextmanager
    def count(self):
        with PeakSavedBytes(params=self.params) as saved:
            yield self
        self.seen = dict(saved.storages)


Key = tuple[int, int]  # (micro-batch, chunk)


@dataclass
class _StepState:
    """What the action handlers of one step share: the step's inputs, the tensors in flight between the forward and
    the backward of each (micro-batch, chunk), the messages, and the running sums."""

    batches: list[tuple[torch.Tensor, torch.Tensor]]
    positions: list[tuple[torch.Tensor, torch.Tensor | None]]  # per micro-batch: its positions and document ids
    autocast: Callable[[], contextlib.AbstractContextManager]
    no_sync: Callable[[], contextlib.AbstractContextManager] | None
    loss_scale: float | torch.Tensor
    wire: InFlight
    chunks: list[int]  # this rank's: a message between two of them goes through `mailbox`
    last_backward: Key | None  # whose backward (its W, when the schedule splits it) runs outside `no_sync`
    loss_sum: torch.Tensor
    aux_sum: torch.Tensor
    stats: StepStats = field(default_factory=StepStats)
    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # received hidden states, requires_grad
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # chunk outputs (the loss sum on the last chunk)
    aux: dict[Key, torch.Tensor] = field(default_factory=dict)  # MoE balancing losses awaiting their backward
    out_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # received gradients of chunk outputs
    in_grads: dict[Key, torch.Tensor] = field(default_factory=dict)  # gradients of chunk inputs, to send back
    held: dict[Key, int] = field(default_factory=dict)  # saved-for-backward bytes per forward not yet backwarded
    weight_work: dict[Key, object] = field(default_factory=dict)  # what each B leaves for its W (split_backward)
    fused: set[Key] = field(default_factory=set)  # B and W back to back: one backward (zero_bubble)
    mailbox: dict[Message, torch.Tensor] = field(default_factory=dict)  # messages between chunks of this rank
    live: int = 0  # the sum of `held`

    def outgoing(self, message: Message) -> torch.Tensor:
        """The tensor a message carries: a chunk's output forward, the gradient of a chunk's input backward."""
        if message.direction == F:
            return self.outputs[(message.mb, message.chunk - 1)].detach()
        return self.in_grads.pop((message.mb, message.chunk + 1))

    def is_local(self, message: Message) -> bool:
        """Whether the message goes between two chunks of this rank (pp=1, the bottom of zbv's V)."""
        sender = message.chunk - 1 if message.direction == F else message.chunk + 1
        return sender in self.chunks and message.chunk in self.chunks

    def incoming(self, a: Action) -> torch.Tensor:
        """The message a RECV action takes, waited for already."""
        message = message_of(a)
        return self.mailbox.pop(message) if self.is_local(message) else self.wire.take(message)

    def quiet_unless_last(self, key: Key) -> contextlib.AbstractContextManager:  # no_sync, but not for the last
        return self.no_sync() if self.no_sync is not None and key != self.last_backward else contextlib.nullcontext()

    def release(self, key: Key) -> None:
        self.live -= self.held.pop(key)

    def hold(self, key: Key, nbytes: int) -> None:
        """Count a forward's saved bytes until its backward releases them."""
        self.held[key] = nbytes
        self.live += nbytes
        self.stats.peak_activation_bytes = max(self.stats.peak_activation_bytes, self.live)
        self.stats.peak_in_flight = max(self.stats.peak_in_flight, len(self.held))


def residual_dtype(stage: nn.Module) -> torch.dtype:
    """The dtype of the hidden states (and their gradients) between stages: the stage's parameters' dtype.

    The embedding's output has its weight's dtype and every residual addition promotes a block's output back to it,
    so under bf16 autocast (fp32 weights, bf16 matmuls) the stream stays fp32, and bf16 weights make it bf16. Every
    stage holds the same parameter dtype, so sender and receiver agree without a message."""
    dtypes = {p.dtype for p in stage.parameters() if p.is_floating_point()}
    if len(dtypes) != 1:
        raise ValueError(f"a pipeline stage needs one parameter dtype for the activations it sends, got "
                         f"{sorted(map(str, dtypes)) or 'none'}")
    return dtypes.pop()


class PipelineRunner:
    """Runs one pipeline rank's action list for a step of `microbatches` micro-batches.

    `comm` is this rank's pipeline group (`topology.comm("pp", ledger)`); peers are pipeline ranks. Receive buffers
    are `activation_shape(tokens)` (default [B, T, d_model]) of `activation_dtype` (default `residual_dtype(stage)`:
    what the sending stage sends), on the inputs' device. Gradients accumulate into the stage's `.grad`s; the caller
    reduces them over data-parallel replicas, clips (`placement.clip_grad_norm_` over the tp and pp groups: each
    parameter's placement names its stage) and steps the optimizer. Messages are posted in the steps of
    `p2p_program` (the rank's program is `self.program`): a send right after its compute, a receive as early as its
    step allows, so the message can travel while the rank computes. Each action kind has one handler (`_HANDLERS`).
    """

    def __init__(self, stage: StageModule, comm: Comm, schedule: str, microbatches: int,
                 virtual_stages: int | None = None, *, activation_dtype: torch.dtype | None = None,
                 activation_shape: Callable[[torch.Tensor], tuple[int, ...]] | None = None,
                 measure_memory: bool = False, with_aux: bool = False) -> None:
        v = stage.virtual_stages if virtual_stages is None else chunks_per_rank(schedule, virtual_stages)
        if v != stage.virtual_stages or comm.size != stage.pp or comm.rank != stage.pp_rank:
            raise ValueError(f"the stage ({stage.pp_rank} of pp={stage.pp}, virtual_stages={stage.virtual_stages}) "
                             f"does not match the runner (rank {comm.rank} of {comm.size}, virtual_stages={v})")
        self.stage, self.comm = stage, comm
        self.pp, self.microbatches, self.schedule = stage.pp, microbatches, schedule
        schedules = build_any_schedule(schedule, stage.pp, microbatches, v)
        self.actions: list[Action] = schedules[stage.pp_rank]
        self.split = any(a.kind == W for a in self.actions)  # zero-bubble: B and W apart
        self.program: list[Planned] = p2p_program(schedules)[stage.pp_rank]
        self.activation_dtype = activation_dtype or residual_dtype(stage)
        d_model = stage.cfg.d_model
        self.activation_shape = activation_shape or (lambda tokens: (*tokens.shape, d_model))
        self.saved = _SavedBytes(stage.parameters()) if measure_memory else None
        self.with_aux = with_aux
        if comm.size > 1:
            # Under NCCL, a group's first operation creates its communicator, and a batch_isend_irecv may be that
            # first operation only if every rank of the group joins it. A tiny collective first lifts the rule.
            device = next(stage.parameters()).device
            comm.all_reduce(torch.zeros(1, device=device))

    # -- one step --------------------------------------------------------------------------------------------------

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
             autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
             no_sync: Callable[[], contextlib.AbstractContextManager] | None = None, *,
             loss_scale: float | torch.Tensor, positions: Positions = None, docs: Docs = None) -> StepStats:
        """Forward and backward every micro-batch (inputs, targets) by the schedule; return the step's stats.

        Every pipeline rank passes the same micro-batches: chunk 0 reads the inputs, the last chunk the targets.
        Every stage gets `positions[m]` for micro-batch m (default 0..T−1, T = the inputs' length; context
        parallelism passes its shard's global positions), whatever its hidden states' shape, and `docs[m]` if any.
        Each micro-batch backpropagates `loss_fn(logits, targets) * loss_scale` (plus its MoE balancing losses / m);
        pass loss_scale = data-parallel replicas / counted targets of the global batch, and divide the returned
        `loss` (a sum) by that count. `no_sync` (e.g. `DataParallel.no_sync`): every backward of this rank but its
        last runs inside it, so an overlapped data-parallel reduction starts during the last backward only.
        """
        if len(batches) != self.microbatches:
            raise ValueError(f"the runner was built for {self.microbatches} micro-batches, got {len(batches)}")
        return self._run(self.actions, self.program, batches, autocast, no_sync, loss_scale, positions, docs)

    @torch.no_grad()
    def evaluate(self, batches: list[tuple[torch.Tensor, torch.Tensor]],
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 positions: Positions = None, docs: Docs = None) -> float:
        """The SUM of the token losses over `batches` (any number of micro-batches), forwards only; the same on every
        rank. Divide by the number of counted targets for the mean."""
        schedules = forward_only(self.pp, len(batches), self.stage.virtual_stages, self.stage.v_shape)
        actions, program = schedules[self.stage.pp_rank], p2p_program(schedules)[self.stage.pp_rank]
        return self._run(actions, program, batches, autocast, None, 1.0, positions, docs).loss

    def _run(self, actions: list[Action], program: list[Planned], batches: list[tuple[torch.Tensor, torch.Tensor]],
             autocast: Callable[[], contextlib.AbstractContextManager],
             no_sync: Callable[[], contextlib.AbstractContextManager] | None,
             loss_scale: float | torch.Tensor, positions: Positions = None, docs: Docs = None) -> StepStats:
        """Run `actions`, each after the program's posts and waits due before it, then wait for the last sends."""
        device = batches[0][0].device  # the compute device: accumulators and receive buffers live there
        positions = positions or [torch.arange(tokens.shape[1], device=tokens.device) for tokens, _ in batches]
        docs = [Documents.build(d) if d is not None else None for d in docs or [None] * len(batches)]  # chunks share it
        s = _StepState(batches, list(zip(positions, docs)), autocast, no_sync, loss_scale,
                       wire=InFlight(self.comm, self.activation_dtype, device), chunks=self.stage.chunks,
                       last_backward=next(((a.mb, a.chunk) for a in reversed(actions) if a.kind in (B, W)), None),
                       loss_sum=torch.zeros((), dtype=torch.float32, device=device),
                       aux_sum=torch.zeros((), dtype=torch.float32, device=device),
                       fused=fused_backwards(actions) if self.split else set())
        due = due_by_action(program, len(actions))
        for index, a in enumerate(actions):
            handler = self._HANDLERS.get(a.kind)
            if handler is None:
                raise ValueError(f"the pipeline executor has no handler for {a.kind} actions ({a})")
            for item in due[index]:  # this gap's batches: posting them is not the action's time
                if isinstance(item, Post):
                    s.wire.post(item, s.outgoing, lambda message: self.activation_shape(batches[message.mb][0]))
            start = time.perf_counter()
            for item in due[index]:  # a RECV action waits for its message (the program puts posts first)
                if isinstance(item, Wait):
                    s.wire.wait(item.message)
            handler(self, s, a)
            s.stats.events.append(Event(self.stage.pp_rank, a, start, time.perf_counter()))
        for item in due[len(actions)]:  # the sends still in flight
            s.wire.wait(item.message)
        return self._totals(s)

    def _totals(self, s: _StepState) -> StepStats:
        """One small all-reduce gives every rank the loss (only the last stage has it) and the summed aux losses."""
        totals = torch.stack([s.loss_sum, s.aux_sum / len(s.batches)])
        if self.pp > 1:
            self.comm.all_reduce(totals)
        s.stats.totals = totals
        return s.stats

    # -- the action handlers: one per action kind ------------------------------------------------------------------

    def _forward(self, s: _StepState, a: Action) -> None:
        """F: run the chunk (and the loss on the last chunk); keep its output and MoE losses for the backward."""
        stage, key, is_last = self.stage, (a.mb, a.chunk), a.chunk == self.stage.n_chunks - 1
        tokens, targets = s.batches[a.mb]
        x = tokens if a.chunk == 0 else s.inputs[key]
        with s.autocast(), (self.saved.count() if self.saved else contextlib.nullcontext()):
            out = stage.forward_chunk(a.chunk, x, *s.positions[a.mb])
            if is_last:
                out = stage.loss_fn(out, targets)
            chunk_aux = stage.aux_loss(stage.layers[a.chunk]) if self.with_aux else None
        s.outputs[key] = out
        if chunk_aux is not None:
            s.aux_sum += chunk_aux.detach().float()
            if chunk_aux.requires_grad:  # a chunk of dense layers (or evaluate) has nothing to backward
                s.aux[key] = chunk_aux.float()
        if is_last:
            s.loss_sum += out.detach().float()
        s.hold(key, sum(self.saved.seen.values()) if self.saved else 0)

    def _backward(self, s: _StepState, a: Action) -> None:
        """B: backpropagate the chunk's output (the scaled loss on the last chunk) and keep its input's gradient.
        Under a zero-bubble schedule only the input's gradient, and what W will need (`split_backward`)."""
        key, is_last = (a.mb, a.chunk), a.chunk == self.stage.n_chunks - 1
        out = s.outputs.pop(key)
        tensors, grads = [out * s.loss_scale if is_last else out], [None if is_last else s.out_grads.pop(key)]
        if key in s.aux:
            tensors.append(s.aux.pop(key) / len(s.batches))
            grads.append(None)
        inputs = [s.inputs.pop(key)] if a.chunk > 0 else []
        if self.split and key not in s.fused:
            dinputs, s.weight_work[key] = backward_input(tensors, grads, inputs)
        else:  # the last backward (its B, or its W when fused here) starts the gradient sync
            with s.quiet_unless_last(key):
                torch.autograd.backward(tensors, grads)
            dinputs = [x.grad for x in inputs]
            s.release(key)
        if a.chunk > 0:
            s.in_grads[key] = dinputs[0]

    def _backward_weight(self, s: _StepState, a: Action) -> None:
        """W: the weights' gradients from what B recorded; the micro-batch's saved tensors go with it."""
        key = (a.mb, a.chunk)
        if key in s.fused:
            return  # its B ran the whole backward
        with s.quiet_unless_last(key):  # the last W reduces once all of its backward calls have run
            backward_weight(s.weight_work.pop(key), s.no_sync or contextlib.nullcontext)
        s.release(key)

    def _receive_forward(self, s: _StepState, a: Action) -> None:
        """RECV_F: the chunk's input, a leaf that collects its gradient when grad is on."""
        s.inputs[(a.mb, a.chunk)] = s.incoming(a).requires_grad_(torch.is_grad_enabled())

    def _receive_backward(self, s: _StepState, a: Action) -> None:
        """RECV_B: the gradient of the chunk's output."""
        s.out_grads[(a.mb, a.chunk)] = s.incoming(a)

    def _send(self, s: _StepState, a: Action) -> None:
        """SEND_F / SEND_B: the program posts sends to other ranks; a message to this rank's next chunk (pp=1) is
        handed over here."""
        if s.is_local(message_of(a)):
            s.mailbox[message_of(a)] = s.outgoing(message_of(a)).clone()

    _HANDLERS: dict[str, Callable[[PipelineRunner, _StepState, Action], None]] = {
        F: _forward, B: _backward, W: _backward_weight, RECV_F: _receive_forward, RECV_B: _receive_backward,
        SEND_F: _send, SEND_B: _send}
