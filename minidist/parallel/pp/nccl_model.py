"""A model of NCCL's point-to-point rules, to replay the order in which ranks post messages without any GPU.

gloo, which the course runs on, forgives a lot: it matches a receive to a send by (peer, tag), and a send does not
wait for its receive. NCCL does neither:

1. **No tags.** Between two ranks, the i-th send from a to b meets the i-th receive that b posted from a (FIFO per
   ordered pair), whatever each side meant to move. If the shapes agree, the wrong tensor lands silently.
2. **Posted operations run in order.** Each operation runs on a CUDA stream, one after the other: a single
   `isend`/`irecv` on the stream of its pair of ranks, a `batch_isend_irecv` (an NCCL group) as one unit on the
   group's stream. An operation can only make progress while its partner on the other rank is running too, so a
   send at the head of a stream blocks everything posted after it until the peer reaches the matching receive.
3. **A wait blocks** until the unit holding the operation has finished (a batch finishes as a whole).

`replay` plays each rank's program, a list of `Post`s and `Wait`s in the order the rank issues them, under these
rules, and reports a deadlock (no rank can move and work is left) and every pairing where the i-th send carries a
different message, or shape, than the i-th receive expects. Messages are labels the caller chooses: NCCL never sees
them, the replay only uses them to check what a pairing moved.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

SEND, RECV = "send", "recv"


class Op(NamedTuple):
    """One point-to-point operation as a rank posts it."""

    kind: str  # SEND or RECV
    peer: int  # the other rank (group rank)
    message: Hashable  # what this rank means to send, or expects to receive
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Post:
    """Operations started together: one `batch_isend_irecv` (batched=True, any number of ops, on the group's stream)
    or one plain `isend`/`irecv` (batched=False, exactly one op, on the stream of its pair of ranks)."""

    ops: tuple[Op, ...]
    batched: bool = True

    def __post_init__(self) -> None:
        if not self.batched and len(self.ops) != 1:
            raise ValueError(f"an unbatched post holds exactly one operation, got {len(self.ops)}")


@dataclass(frozen=True)
class Wait:
    """Block this rank until the post that holds its operation for `message` has finished."""

    message: Hashable


@dataclass
class Outcome:
    deadlock: bool
    blocked: dict[int, str] = field(default_factory=dict)  # rank -> why it cannot move (when deadlocked)
    stuck: dict[int, list[Op]] = field(default_factory=dict)  # rank -> the unfinished ops at its streams' heads
    mismatches: list[str] = field(default_factory=list)  # "rank a -> rank b, pair i: sent X, expected Y"
    pairs: int = 0  # send/receive pairs that completed

    @property
    def ok(self) -> bool:
        return not self.deadlock and not self.mismatches


@dataclass
class _Unit:
    """A post on one rank's stream; `done[i]` once op i has met its partner."""

    rank: int
    stream: tuple
    ops: tuple[Op, ...]
    done: list[bool]

    @property
    def finished(self) -> bool:
        return all(self.done)


def replay(programs: Sequence[Sequence[Post | Wait]]) -> Outcome:
    """Play every rank's program under NCCL's rules (module docstring) until all is done or nothing can move."""
    return _Replay(programs).run()


class _Replay:
    """The state of one replay: each rank's place in its program, its streams, and the queues of every pair."""

    def __init__(self, programs: Sequence[Sequence[Post | Wait]]) -> None:
        self.programs, self.world = programs, len(programs)
        self.cursor = [0] * self.world
        self.streams: dict[tuple, list[_Unit]] = {}  # (rank, stream) -> units not finished yet, in posting order
        self.holder: list[dict[Hashable, _Unit]] = [{} for _ in programs]  # message -> this rank's unit holding it
        # Per ordered pair (src, dst): the sends src posted to dst and the receives dst posted from src, in order.
        self.sends: dict[tuple[int, int], list[tuple[_Unit, int]]] = {}
        self.recvs: dict[tuple[int, int], list[tuple[_Unit, int]]] = {}
        self.checked: dict[tuple[int, int], int] = {}  # pairings already compared, per ordered pair
        self.completed: dict[tuple[int, int], int] = {}  # pairings that have moved their data, per ordered pair
        self.outcome = Outcome(deadlock=False)

    def run(self) -> Outcome:
        while self.move_hosts() | self.move_streams():
            pass
        outcome = self.outcome
        for rank, program in enumerate(self.programs):
            if self.cursor[rank] < len(program):
                outcome.blocked[rank] = f"waits on {program[self.cursor[rank]].message!r}"
        for (rank, stream), queue in self.streams.items():
            if queue:
                head = [op for op, done in zip(queue[0].ops, queue[0].done) if not done]
                outcome.blocked.setdefault(rank, f"stream {stream} stuck on {head}")
                outcome.stuck.setdefault(rank, []).extend(head)
        outcome.deadlock = bool(outcome.blocked)
        return outcome

    def post(self, rank: int, item: Post) -> None:
        for op in item.ops:
            if not 0 <= op.peer < self.world or op.peer == rank:
                raise ValueError(f"rank {rank} posts {op} to a peer outside 0..{self.world - 1} or to itself")
        stream = ("group",) if item.batched else ("pair", min(rank, item.ops[0].peer), max(rank, item.ops[0].peer))
        unit = _Unit(rank, stream, item.ops, [False] * len(item.ops))
        self.streams.setdefault((rank, stream), []).append(unit)
        for i, op in enumerate(item.ops):
            self.holder[rank][op.message] = unit
            if op.kind == SEND:
                self.sends.setdefault((rank, op.peer), []).append((unit, i))
            else:
                self.recvs.setdefault((op.peer, rank), []).append((unit, i))

    def running(self, unit: _Unit) -> bool:
        """At the head of its stream: everything posted before it has finished."""
        return self.streams[(unit.rank, unit.stream)][0] is unit

    def move_hosts(self) -> bool:
        """Advance every rank through its program: posts go on, a wait holds the rank until its unit has finished."""
        moved = False
        for rank, program in enumerate(self.programs):
            while self.cursor[rank] < len(program):
                item = program[self.cursor[rank]]
                if isinstance(item, Post):
                    self.post(rank, item)
                else:
                    unit = self.holder[rank].get(item.message)
                    if unit is None:
                        raise ValueError(f"rank {rank} waits on {item.message!r}, which it never posted")
                    if not unit.finished:
                        break
                self.cursor[rank] += 1
                moved = True
        return moved

    def move_streams(self) -> bool:
        """Check each new pairing, complete those whose units both run, then start the units next in line."""
        moved = False
        for pair, queue in self.sends.items():
            other = self.recvs.get(pair, [])
            self.check_pairings(pair, queue, other)
            # A pair of ranks moves its messages in order: the next pairing goes once both of its units run.
            i = self.completed.get(pair, 0)
            while i < self.checked[pair] and self.running(queue[i][0]) and self.running(other[i][0]):
                (s, si), (r, ri) = queue[i], other[i]
                s.done[si] = r.done[ri] = True
                i += 1
                moved = True
            self.outcome.pairs += i - self.completed.get(pair, 0)
            self.completed[pair] = i
        for queue in self.streams.values():  # finished units leave their stream; the next one starts
            while queue and queue[0].finished:
                queue.pop(0)
        return moved

    def check_pairings(self, pair: tuple[int, int], queue: list[tuple[_Unit, int]],
                       other: list[tuple[_Unit, int]]) -> None:
        """Compare each new pairing of the i-th send with the i-th receive once: same message, same shape."""
        for i in range(self.checked.get(pair, 0), min(len(queue), len(other))):
            (s, si), (r, ri) = queue[i], other[i]
            sent, want = s.ops[si], r.ops[ri]
            if (sent.message, sent.shape) != (want.message, want.shape):
                self.outcome.mismatches.append(f"rank {pair[0]} -> rank {pair[1]}, pair {i}: sent {sent.message} "
                                               f"{sent.shape}, the receive expected {want.message} {want.shape}")
        self.checked[pair] = min(len(queue), len(other))
