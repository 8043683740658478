"""Pipeline schedules as data, and a simulator that turns them into timelines (chapter 09).

A schedule is a list per pipeline rank of `Action`s, run in order by one executor (`minidist.parallel.pp.pipeline`).
The model is cut into p·v *chunks* (p ranks, v virtual stages per rank); chunk c lives on rank c mod p, so rank r
holds chunks r, r+p, r+2p, ... A micro-batch flows forward through chunks 0 .. pv−1 and its gradient flows back.

    F(mb, c)       forward of micro-batch mb through chunk c
    B(mb, c)       backward of micro-batch mb through chunk c
    SEND_F(mb, c)  send chunk c's output to the rank of chunk c+1   RECV_F(mb, c)  receive chunk c's input
    SEND_B(mb, c)  send the gradient of chunk c's input to c−1      RECV_B(mb, c)  receive the gradient of c's output

Sends never block; a receive blocks until its message has arrived. The schedules below first give each rank its
order of F and B (the only thing that differs between them), then `with_communication` adds the sends and receives
every schedule needs in the same way.

- AFAB / GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline
  Parallelism", §2.2): all forwards, then all backwards. Rank r holds the activations of all m micro-batches.
- 1F1B (Narayanan et al. 2019, "PipeDream: Generalized Pipeline Parallelism for DNN Training"; the flushed variant
  of Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
  §2.2.1): p−r−1 warm-up forwards, then alternate one forward and one backward, then drain. Same bubble as AFAB,
  but at most p−r micro-batches in flight on rank r instead of m.
- Interleaved 1F1B (the same 2021 paper, §2.2.2): v chunks per rank, worked through in groups of (at least) p
  micro-batches; the bubble shrinks by v at the price of v times as many messages.

With t_f, t_b the forward and backward time of one micro-batch on one rank (all chunks of the rank together) and
no communication cost, the time a rank spends idle in one step, as a fraction of the step (`bubble_formula`):

    AFAB, 1F1B       (p−1)·(t_f+t_b) / ((m+p−1)·(t_f+t_b))     = (p−1) / (m+p−1)
    interleaved      (p−1)·(t_f+t_b)/v / ((m+(p−1)/v)·(t_f+t_b)) = (p−1) / (v·m+p−1)

The 2021 paper states the bubble relative to the ideal time instead: (p−1)/m, and (1/v)·(p−1)/m interleaved;
fraction-of-step f and relative b are the same thing, f = b/(1+b). `simulate` reproduces these exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

F, B, W = "F", "B", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (F, B, W)
SCHEDULES = ("afab", "1f1b", "interleaved")  # chapter 09: B is the whole backward
ZB_SCHEDULES = ("zb1", "zbv", "dualpipev")  # chapter 15 (minidist.parallel.pp.zero_bubble): B and W split
ALL_SCHEDULES = SCHEDULES + ZB_SCHEDULES
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per rank in a V: rank r holds chunks r and 2p−1−r


class Action(NamedTuple):
    kind: str  # F, B, W, SEND_F, RECV_F, SEND_B, RECV_B
    mb: int  # micro-batch
    chunk: int  # global chunk (virtual stage) index, 0 .. p·v−1

    def __repr__(self) -> str:
        return f"{self.kind}{self.mb}" + (f"c{self.chunk}" if self.chunk else "")


def chunk_rank(chunk: int, pp: int, v_shape: bool = False) -> int:
    """The pipeline rank that holds `chunk`: chunk mod p (a loop), or under the V placement (zbv) r for the first
    p chunks and 2p−1−c for the others, so that rank 0 holds the first and the last."""
    if v_shape:
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp


def rank_chunks(rank: int, pp: int, virtual_stages: int = 1, v_shape: bool = False) -> list[int]:
    """The chunks rank `rank` holds, in model order: rank, rank+p, rank+2p, ... (V: rank and 2p−1−rank)."""
    if v_shape:
        return [rank, 2 * pp - 1 - rank]
    return [rank + j * pp for j in range(virtual_stages)]


def chunk_owners(schedule: list[list[Action]]) -> dict[int, int]:
    """The chunk → rank map a schedule's data says: where each chunk's compute actions are."""
    return {a.chunk: r for r, order in enumerate(schedule) for a in order if a.kind in COMPUTE}


# ---------------------------------------------------------------------------------------------------------------
# The compute order of each schedule
# ---------------------------------------------------------------------------------------------------------------


def afab_order(pp: int, microbatches: int) -> list[list[Action]]:
    """GPipe: every rank runs F of all micro-batches, then B of all of them."""
    m = microbatches
    return [[Action(F, i, r) for i in range(m)] + [Action(B, i, r) for i in range(m)] for r in range(pp)]


def one_f_one_b_order(pp: int, microbatches: int) -> list[list[Action]]:
    """1F1B: rank r warms up with p−r−1 forwards, then alternates F and B, then drains the backwards.

    The last rank has no warm-up: it runs each micro-batch's backward right after its forward, so that gradient
    starts flowing back as early as possible; rank r then holds at most p−r micro-batches' activations.
    """
    m = microbatches
    orders = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        order = [Action(F, i, r) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action(F, warmup + i, r), Action(B, i, r)]
        order += [Action(B, i, r) for i in range(m - warmup, m)]
        orders.append(order)
    return orders


def interleaved_groups(pp: int, microbatches: int) -> list[int]:
    """Sizes of the micro-batch groups of interleaved 1F1B: m // p groups, as even as possible, each >= p.

    A rank works through one group chunk by chunk. A group must hold at least p micro-batches: the output of the
    group's first micro-batch on chunk j needs p forward units to come back round to this rank as the input of
    chunk j+1, and the rank has exactly the group's other micro-batches to work on meanwhile. Megatron-LM's groups
    are exactly p (it asks m to be a multiple of p); spreading the remainder over the groups keeps the bubble at
    the formula's value for any m >= p.
    """
    k = microbatches // pp
    return [microbatches // k + (1 if i < microbatches % k else 0) for i in range(k)]


def _interleaved_units(groups: list[int], virtual_stages: int, backward: bool) -> list[tuple[int, int]]:
    """(micro-batch, local chunk) in the order a rank works on them: group by group, chunk by chunk.

    The forward visits a group's chunks 0, 1, .., v−1, the backward v−1, .., 0.
    """
    chunks = range(virtual_stages - 1, -1, -1) if backward else range(virtual_stages)
    units, start = [], 0
    for size in groups:
        units += [(mb, j) for j in chunks for mb in range(start, start + size)]
        start += size
    return units


def interleaved_order(pp: int, microbatches: int, virtual_stages: int) -> list[list[Action]]:
    """Interleaved 1F1B (Megatron-LM 2021, §2.2.2): v chunks per rank, 1F1B over (micro-batch, chunk) units.

    Rank r runs (v−1)·s + 2(p−r−1) forward units before its first backward (s = the first group's size): (v−1)·s
    fill its earlier chunks for the first group, then the rank's last chunk needs the round trip through the ranks
    after it. With free communication p−r−1 extra units would already give the formula's bubble; Megatron-LM's
    2(p−r−1) leave slack, so that message latency does not stall the steady phase (`simulate(..., comm=c)` shows
    the difference). Then the rank alternates one forward and one backward unit, then drains the backwards.
    """
    p, m, v = pp, microbatches, virtual_stages
    groups = interleaved_groups(p, m)
    forward = _interleaved_units(groups, v, backward=False)
    backward = _interleaved_units(groups, v, backward=True)
    total = m * v
    orders = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * groups[0], total)
        f = [Action(F, mb, j * p + r) for mb, j in forward]
        b = [Action(B, mb, j * p + r) for mb, j in backward]
        order = f[:warmup]
        for i in range(total - warmup):
            order += [f[warmup + i], b[i]]
        order += b[total - warmup:]
        orders.append(order)
    return orders


def with_communication(orders: list[list[Action]], pp: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Add to each rank's compute order the receives before and the sends after each F and B (W moves nothing)."""
    last = pp * virtual_stages - 1
    out = []
    for order in orders:
        actions = []
        for a in order:
            if a.kind == F:
                if a.chunk > 0:
                    actions.append(Action(RECV_F, a.mb, a.chunk))
                actions.append(a)
                if a.chunk < last:
                    actions.append(Action(SEND_F, a.mb, a.chunk))
            elif a.kind == B:
                if a.chunk < last:
                    actions.append(Action(RECV_B, a.mb, a.chunk))
                actions.append(a)
                if a.chunk > 0:
                    actions.append(Action(SEND_B, a.mb, a.chunk))
            else:
                actions.append(a)
        out.append(actions)
    return out


def check_schedule_args(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> None:
    """One-line ValueError unless (schedule, p, m, v) make a schedule this module can build."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {SCHEDULES}")
    for name, value in (("pp", pp), ("microbatches", microbatches), ("virtual_stages", virtual_stages)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if schedule != "interleaved" and virtual_stages != 1:
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule='interleaved' ({schedule!r} runs one "
                         "chunk per rank); use --schedule interleaved or --virtual-stages 1")
    if schedule == "interleaved" and microbatches < pp:
        raise ValueError(f"interleaved 1F1B needs microbatches >= pp, got microbatches={microbatches} < pp={pp}; "
                         f"use microbatches >= {pp}, or schedule '1f1b'")


def build_schedule(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Every rank's ordered actions, communication included, for schedule 'afab', '1f1b' or 'interleaved'."""
    check_schedule_args(schedule, pp, microbatches, virtual_stages)
    if schedule == "afab":
        orders = afab_order(pp, microbatches)
    elif schedule == "1f1b":
        orders = one_f_one_b_order(pp, microbatches)
    else:
        orders = interleaved_order(pp, microbatches, virtual_stages)
    return with_communication(orders, pp, virtual_stages)


def forward_only(pp: int, microbatches: int, virtual_stages: int = 1, v_shape: bool = False) -> list[list[Action]]:
    """Forwards only (evaluation): each rank runs its chunks in model order, all micro-batches through each."""
    orders = [[Action(F, i, c) for c in rank_chunks(r, pp, virtual_stages, v_shape) for i in range(microbatches)]
              for r in range(pp)]
    return [[a for a in order if a.kind in (F, SEND_F, RECV_F)]
            for order in with_communication(orders, pp, virtual_stages)]


def bubble_formula(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle time as a fraction of the step: (p−1)/(m+p−1), interleaved (p−1)/(v·m+p−1); the zero-bubble schedules
    (chapter 15) at T_F = T_B = T_W (`zb_bubble_formula` for other costs)."""
    if schedule in ZB_SCHEDULES:
        return zb_bubble_formula(schedule, pp, microbatches)
    v = virtual_stages if schedule == "interleaved" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def zb_makespan(schedule: str, pp: int, microbatches: int, t_f: float, t_b: float, t_w: float) -> float:
    """The step's length of 1F1B and the zero-bubble schedules (minidist.parallel.pp.zero_bubble, which derives
    them) with B and W apart: t_* per micro-batch per rank, all its chunks together."""
    work = microbatches * (t_f + t_b + t_w)
    if schedule == "1f1b":
        return work + (pp - 1) * (t_f + t_b + t_w)
    if schedule == "zb1":
        return work + (pp - 1) * max(t_f, t_b, t_f + t_b - t_w)
    if schedule == "zbv":
        return work + (pp - 1) * max(t_b / 2, t_w / 2, t_f - t_b / 2, t_f - t_w, t_b - t_w)
    if schedule == "dualpipev" and t_f == t_b == t_w:  # other ratios: the simulator (no closed form derived)
        return work + (pp - 1) * t_f / 2
    if schedule == "dualpipev":
        raise ValueError("dualpipev's step time has a closed form only at T_F = T_B = T_W; simulate() it otherwise")
    raise ValueError(f"no zero-bubble formula for schedule {schedule!r}; choose one of ('1f1b',) + {ZB_SCHEDULES}")


def zb_bubble_formula(schedule: str, pp: int, microbatches: int, t_f: float = 1.0, t_b: float = 1.0,
                      t_w: float = 1.0) -> float:
    """Idle time as a fraction of the step: 1 − m(T_F+T_B+T_W) / makespan."""
    return 1.0 - microbatches * (t_f + t_b + t_w) / zb_makespan(schedule, pp, microbatches, t_f, t_b, t_w)


# ---------------------------------------------------------------------------------------------------------------
# Timelines: simulated (from costs) or measured (from the executor's timestamps)
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Event:
    rank: int
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    """What each rank did when. The bubble counts the time a rank is not computing (waiting on receives or idle)."""

    pp: int
    events: list[Event] = field(default_factory=list)

    @property
    def start(self) -> float:
        return min(e.start for e in self.events)

    @property
    def makespan(self) -> float:
        return max(e.end for e in self.events) - self.start

    def busy(self, rank: int) -> float:
        return sum(e.end - e.start for e in self.events if e.rank == rank and e.action.kind in COMPUTE)

    def bubble_fraction(self) -> float:
        """1 − (compute time summed over ranks) / (p · makespan)."""
        return 1.0 - sum(self.busy(r) for r in range(self.pp)) / (self.pp * self.makespan)

    def compute_events(self, rank: int | None = None) -> list[Event]:
        return [e for e in self.events if e.action.kind in COMPUTE and rank in (None, e.rank)]


def _message_key(a: Action) -> tuple[str, int, int]:
    """The message a send or receive moves: (direction, micro-batch, chunk that consumes it)."""
    if a.kind == SEND_F:
        return F, a.mb, a.chunk + 1
    if a.kind == RECV_F:
        return F, a.mb, a.chunk
    if a.kind == SEND_B:
        return B, a.mb, a.chunk - 1
    return B, a.mb, a.chunk


def simulate(schedule: list[list[Action]], forward: float | Callable[[Action], float] = 1.0,
             backward: float | Callable[[Action], float] = 2.0, comm: float = 0.0,
             weight: float | Callable[[Action], float] = 1.0) -> Timeline:
    """Run the schedule on paper: each rank executes its actions in order, a compute action takes its cost, a send
    takes no time and its message arrives `comm` later, a receive waits for its message. No model is run.

    `forward`/`backward`/`weight` are the cost of one F/B/W action (one micro-batch through one chunk), or functions
    of the action (under a B/W split, `backward` is the input-gradient half B alone).
    Checks the schedule as it goes: a compute action whose input was never received, or a schedule that deadlocks
    (every rank waiting on a message nobody will send), raises ValueError.
    """
    pp = len(schedule)
    n_chunks = 1 + max(a.chunk for order in schedule for a in order)
    cost_f = forward if callable(forward) else (lambda a, c=forward: c)
    cost_b = backward if callable(backward) else (lambda a, c=backward: c)
    cost_w = weight if callable(weight) else (lambda a, c=weight: c)
    arrival: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * pp
    cursor = [0] * pp
    have: list[set] = [set() for _ in range(pp)]  # inputs/gradients received, forwards done
    timeline = Timeline(pp)
    while any(cursor[r] < len(schedule[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while cursor[r] < len(schedule[r]):
                a = schedule[r][cursor[r]]
                t = clock[r]
                if a.kind in (SEND_F, SEND_B):
                    arrival[_message_key(a)] = t + comm
                    end = t
                elif a.kind in (RECV_F, RECV_B):
                    key = _message_key(a)
                    if key not in arrival:
                        break  # blocked: try the other ranks
                    end = max(t, arrival[key])
                    have[r].add(a)
                else:
                    _check_ready(a, have[r], n_chunks)
                    end = t + (cost_f(a) if a.kind == F else cost_b(a) if a.kind == B else cost_w(a))
                    have[r].add(a)
                timeline.events.append(Event(r, a, t, end))
                clock[r] = end
                cursor[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: schedule[r][cursor[r]] for r in range(pp) if cursor[r] < len(schedule[r])}
            raise ValueError(f"schedule deadlocks: ranks wait on {stuck} and no rank can move")
    return timeline


def _check_ready(a: Action, have: set, n_chunks: int) -> None:
    if a.kind == F and a.chunk > 0 and Action(RECV_F, a.mb, a.chunk) not in have:
        raise ValueError(f"{a} runs before its input was received (no RECV_F{a.mb}c{a.chunk} before it)")
    if a.kind == B:
        if Action(F, a.mb, a.chunk) not in have:
            raise ValueError(f"{a} runs before its forward")
        if a.chunk < n_chunks - 1 and Action(RECV_B, a.mb, a.chunk) not in have:
            raise ValueError(f"{a} runs before the gradient of its output was received")
    if a.kind == W and Action(B, a.mb, a.chunk) not in have:
        raise ValueError(f"{a} runs before its B (the gradients W starts from)")


def check_complete(schedule: list[list[Action]], pp: int, microbatches: int, virtual_stages: int = 1,
                   v_shape: bool = False) -> None:
    """ValueError unless each F and B (and W, if the schedule splits the backward) of every (micro-batch, chunk)
    appears exactly once, on the chunk's rank."""
    kinds = COMPUTE if any(a.kind == W for order in schedule for a in order) else (F, B)
    want = {(k, mb, c) for k in kinds for mb in range(microbatches) for c in range(pp * virtual_stages)}
    seen: list[tuple[str, int, int]] = []
    for r, order in enumerate(schedule):
        for a in order:
            if a.kind in COMPUTE:
                owner = chunk_rank(a.chunk, pp, v_shape)
                if owner != r:
                    raise ValueError(f"{a} is on rank {r}, but chunk {a.chunk} lives on rank {owner}")
                seen.append(tuple(a))
    if len(seen) != len(set(seen)) or set(seen) != want:
        missing, extra = sorted(want - set(seen)), sorted(set(seen) - want)
        raise ValueError(f"schedule incomplete: missing {missing[:4]}, unexpected {extra[:4]}, "
                         f"{len(seen) - len(set(seen))} duplicated")


# ---------------------------------------------------------------------------------------------------------------
# Drawing
# ---------------------------------------------------------------------------------------------------------------


def draw_timeline(timeline: Timeline, ax, title: str = "", label_mb: bool = True) -> None:
    """One row per rank, one box per compute action: forwards blue, backwards orange (W green), shade by chunk."""
    import matplotlib.colors as mcolors

    t0 = timeline.start
    n_chunks = 1 + max(e.action.chunk for e in timeline.events)
    span = timeline.makespan
    for e in timeline.compute_events():
        base = {F: "tab:blue", B: "tab:orange", W: "tab:green"}[e.action.kind]
        # Later virtual stages of a rank are drawn darker.
        local = e.action.chunk // timeline.pp
        levels = max(1, n_chunks // timeline.pp)
        shade = 1.0 - 0.45 * local / max(1, levels - 1) if levels > 1 else 1.0
        color = tuple(c * shade for c in mcolors.to_rgb(base))
        ax.barh(e.rank, e.end - e.start, left=e.start - t0, height=0.8, color=color, edgecolor="white", lw=0.5)
        if label_mb and (e.end - e.start) > 0.012 * span:
            ax.text((e.start + e.end) / 2 - t0, e.rank, str(e.action.mb), ha="center", va="center", fontsize=7,
                    color="white")
    ax.set_yticks(range(timeline.pp))
    ax.set_yticklabels([f"rank {r}" for r in range(timeline.pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, span)
    ax.set_title(title or f"bubble {timeline.bubble_fraction():.1%}")
