"""The pipeline's point-to-point messages: when each rank posts them, and posting them (chapter 09).

A schedule (`minidist.parallel.pp.schedules`) says when a rank sends and receives, as if sends never blocked and a
receive could pick its message out of the air. NCCL is stricter (`minidist.parallel.pp.nccl_model`): it has no tags, so
between two ranks the i-th send meets the i-th receive, and an operation blocks its stream until the peer runs the
matching one. Posting each message where the action list names it then deadlocks as soon as two neighbours each
start with a send the other has not yet posted the receive for (1F1B on two ranks with three micro-batches already).

So the executor posts in **steps**, as Megatron-LM's batched calls (`send_forward_recv_backward`, ...) do: one
global sequence of steps, and each rank posts all its sends and receives of a step together, in one
`batch_isend_irecv` (an NCCL group), while its neighbours post the matching ones in the same step. The steps come
from playing the schedule on paper (`simulate`, forward 1, backward 2): a message's step is the time its sender
finishes computing it (ties broken in the direction messages flow). A rank posts its batches in step order, a
step with a send right after that send's compute; a step in which it only receives one compute before it needs the
message where the order allows, so the message can land while the rank computes.

Why this cannot deadlock: a rank waits on a message in the gap before the compute that needs it, which on paper
starts no earlier than the message's time, and every gap before a step's place is left before the step's time. So
before posting step k a rank has only waited on steps before k, and by induction every rank of step k posts it,
everything each posted earlier has finished, and the batches of step k all run at once and meet. Why it cannot mix
messages up: both ends of a pair post their common messages in the same order, step by step, sorted within a step.

`p2p_program` turns a schedule into each rank's program of `Post`s and `Wait`s, each due before one of the rank's
actions; `PipelineRunner` runs exactly that program, and the tests replay it under `nccl_model.replay`.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from minidist.comm.communicator import Comm, Handle
from minidist.parallel.pp.nccl_model import RECV, SEND, Op, Post, Wait
from minidist.parallel.pp.schedules import (
    COMPUTE,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    Action,
    B,
    F,
    chunk_owners,
    chunk_rank,
    simulate,
)


class Message(NamedTuple):
    """What travels between chunks: the input of `chunk` (direction F) or the gradient of its output (B)."""

    direction: str
    mb: int
    chunk: int  # the chunk that consumes the message


def message_of(a: Action) -> Message:
    """The message a SEND_F/RECV_F/SEND_B/RECV_B action moves."""
    if a.kind == SEND_F:
        return Message(F, a.mb, a.chunk + 1)
    if a.kind == SEND_B:
        return Message(B, a.mb, a.chunk - 1)
    if a.kind in (RECV_F, RECV_B):
        return Message(F if a.kind == RECV_F else B, a.mb, a.chunk)
    raise ValueError(f"{a} moves no message")


def peer_of(a: Action, pp: int, owners: dict[int, int] | None = None) -> int:
    """The pipeline rank on the other end of a communication action; `owners` (chunk → rank, from
    `schedules.chunk_owners`) for a placement other than chunk mod p."""
    chunk = a.chunk + 1 if a.kind in (SEND_F, RECV_B) else a.chunk - 1
    return owners[chunk] if owners is not None else chunk_rank(chunk, pp)


class Planned(NamedTuple):
    at: int  # index of the action this item runs before (len(actions): after the last one)
    item: Post | Wait


def p2p_program(schedule: list[list[Action]],
                shape: Callable[[Message], tuple[int, ...]] | None = None) -> list[list[Planned]]:
    """Every rank's posts and waits for `schedule` (module docstring), in the order the rank issues them.

    Messages between chunks of one rank (pp=1 with virtual stages, the bottom of zbv's V) are handed over locally
    and appear nowhere.
    `shape(message)` only labels the operations (for `nccl_model.replay`); the executor sizes its own buffers.
    """
    pp = len(schedule)
    owners = chunk_owners(schedule)
    timeline = simulate(schedule)
    starts = [[e.start for e in timeline.events if e.rank == r] for r in range(pp)]  # one per action, in order
    # A message's step: the time its sender finishes computing it; at a tie, forward messages first, each direction
    # in the order it flows (so that a rank's receive comes before its own send of that time, and can go early).
    step_of = {message_of(a): (starts[r][i], 0, r) if a.kind == SEND_F else (starts[r][i], 1, -r)
               for r, actions in enumerate(schedule) for i, a in enumerate(actions) if a.kind in (SEND_F, SEND_B)}
    programs = []
    for r, actions in enumerate(schedule):
        # The gaps between compute actions: their first action index, and the time the rank leaves them (the start
        # of the next compute). A step's place is the first gap the rank leaves at or after the step's time.
        gap_at, gap_leaves, first = [], [], 0
        for i, a in enumerate(actions):
            if a.kind in COMPUTE:
                gap_at.append(first)
                gap_leaves.append(starts[r][i])
                first = i + 1
        gap_at.append(first)
        gap_leaves.append(math.inf)
        ops: dict[tuple[float, int, int], list[Op]] = {}  # step -> this rank's operations in it
        sending: set[tuple[float, int, int]] = set()  # the steps in which this rank sends
        waits: dict[int, Message] = {}  # action index -> the message its RECV waits for
        for i, a in enumerate(actions):
            if a.kind in COMPUTE or peer_of(a, pp, owners) == r:
                continue
            message = message_of(a)
            kind = SEND if a.kind in (SEND_F, SEND_B) else RECV
            op = Op(kind, peer_of(a, pp, owners), message, shape(message) if shape else None)
            ops.setdefault(step_of[message], []).append(op)
            if kind == SEND:
                sending.add(step_of[message])
            else:
                waits[i] = message
        posts_at: dict[int, list[Post]] = {}
        gap = 0
        for step in sorted(ops):  # one batch per step, in step order
            own = bisect.bisect_left(gap_leaves, step[0])
            # A step with a send goes right after the send's compute. A step in which this rank only receives goes
            # one compute earlier where the order allows, so that the message can land during that compute.
            gap = own if step in sending else max(gap, own - 1)
            posts_at.setdefault(gap_at[gap], []).append(Post(tuple(sorted(ops[step]))))
        program = []
        for i in range(len(actions) + 1):
            program += [Planned(i, post) for post in posts_at.get(i, [])]
            if i in waits:
                program.append(Planned(i, Wait(waits[i])))
        sent = sorted(op.message for step in sending for op in ops[step] if op.kind == SEND)
        program += [Planned(len(actions), Wait(m)) for m in sent]  # every send done before the step ends
        programs.append(program)
    return programs


def posting_order(schedule: list[list[Action]],
                  shape: Callable[[Message], tuple[int, ...]] | None = None) -> list[list[Post | Wait]]:
    """Each rank's posts and waits without their positions: the input of `nccl_model.replay`."""
    return [[planned.item for planned in program] for program in p2p_program(schedule, shape)]


class InFlight:
    """One step's messages on the wire: posts planned batches through `Comm` (which records them in its ledger) and
    hands out the receive buffers, allocated on the compute device, once waited for."""

    def __init__(self, comm: Comm, dtype: torch.dtype, device: torch.device) -> None:
        self.comm, self.dtype, self.device = comm, dtype, device
        self.receiving: dict[Message, tuple[torch.Tensor, list[Handle]]] = {}
        self.sending: dict[Message, list[Handle]] = {}
        self.received: dict[Message, torch.Tensor] = {}

    def post(self, post: Post, outgoing: Callable[[Message], torch.Tensor],
             shape: Callable[[Message], tuple[int, ...]]) -> None:
        """Start one step's batch: `outgoing(message)` gives each tensor to send, `shape(message)` each receive's."""
        recvs = [op for op in post.ops if op.kind == RECV]
        sends = [op for op in post.ops if op.kind == SEND]
        buffers = {op.message: torch.empty(shape(op.message), dtype=self.dtype, device=self.device) for op in recvs}
        sent = [(outgoing(op.message), op.peer) for op in sends]
        for (tensor, _), op in zip(sent, sends):  # the peer receives into a buffer of self.dtype: bytes, not values
            if tensor.dtype != self.dtype:
                raise ValueError(f"pipeline message {op.message} is {tensor.dtype}, but the receiving stage expects "
                                 f"{self.dtype}; give the runner that activation_dtype")
        handles = self.comm.exchange(sent, [(buffers[op.message], op.peer) for op in recvs])
        # gloo gives one handle per operation (receives first), NCCL one for the whole group: a message waits on its
        # own handle where it has one, else on the group's.
        ops = recvs + sends
        own = {op.message: [h] for op, h in zip(ops, handles)} if len(handles) == len(ops) else {}
        # A send in flight keeps its tensor alive: forget the finished ones now rather than at the end of the step.
        self.sending = {m: hs for m, hs in self.sending.items() if not all(h.is_completed() for h in hs)}
        for op in sends:
            self.sending[op.message] = own.get(op.message, handles)
        for op in recvs:
            self.receiving[op.message] = (buffers[op.message], own.get(op.message, handles))

    def wait(self, message: Message) -> None:
        """Block until `message`'s batch has finished; a received message is then ready for `take`."""
        if message in self.receiving:
            buffer, handles = self.receiving.pop(message)
            self.received[message] = buffer
        else:
            handles = self.sending.pop(message, [])  # absent: finished and already forgotten
        for handle in handles:
            handle.wait()

    def take(self, message: Message) -> torch.Tensor:
        return self.received.pop(message)


def due_by_action(program: list[Planned], n_actions: int) -> list[list[Post | Wait]]:
    """The program's items by the index of the action they come before (n_actions: after the last)."""
    due: list[list[Post | Wait]] = [[] for _ in range(n_actions + 1)]
    for planned in program:
        due[planned.at].append(planned.item)
    return due
