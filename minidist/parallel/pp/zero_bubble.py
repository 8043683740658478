"""Zero-bubble schedules as data (chapter 15): the backward split into B and W, and W used to fill the bubble.

B(mb, c) computes the gradient of chunk c's input (the previous chunk waits for it), W(mb, c) the gradients of its
weights (only the optimizer waits for them; `minidist.parallel.pp.split_backward` computes the two halves). With
T_F, T_B, T_W the cost of F, B, W of one micro-batch on one rank (all its chunks together), p ranks, m micro-batches:

- **ZB-H1** (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3.1, Fig. 3): 1F1B with B and W apart. Rank r
  warms up with p−1−r forwards as 1F1B does, then runs F, B and the W of r micro-batches back: the W's it owes
  fill the waits of the cool-down. B alone is on the critical path: the first gradient is back at rank 0 after
  (p−1)(T_F+T_B) less than in 1F1B, and the r W's held back fill the drain. The step lasts

      m(T_F+T_B+T_W) + (p−1)(T_F+T_B−T_W)      against 1F1B's  m(T_F+T_B+T_W) + (p−1)(T_F+T_B+T_W)

  for T_W ≤ min(T_F, T_B), a third of 1F1B's bubble when the three are equal. In general each of the p−1 steps of
  the fill and drain still takes at least one F and one B: (p−1)·max(T_F, T_B, T_F+T_B−T_W) (the simulator agrees
  over every ratio tested). Rank r holds at most p activations awaiting their W (1F1B's rank 0: the same peak).
- **ZB-V** (§6, Fig. 8): two chunks per rank placed in a V, rank r holds chunks r and 2p−1−r, so rank 0 holds the
  first and the last chunk (the loss) and a micro-batch goes down the ranks and back up. The warm-up on the first
  leg meets the second leg at the bottom of the V. Until its last forward each W runs right after its B; in the
  cool-down rank r holds back 2r W's (one per chunk per rank of depth), which fill its waits for gradients, and
  runs the held W's last. Found with the simulator and checked by it over every (p, m >= 2p) and ratio tested:

      m(T_F+T_B+T_W) + (p−1)·max(T_B/2, T_W/2, T_F − T_B/2, T_F − T_W, T_B − T_W)

  At equal costs (p−1)·T/2, a sixth of 1F1B's bubble: half a stage's forward per rank of depth, which no schedule
  avoids (rank p−1 starts when the first micro-batch has crossed p−1 chunks). The paper's (p−1)(T_F+T_B−2T_W)
  counts it zero. Holding the W's back raises no peak: at most 2p chunk activations per rank, the bytes of 1F1B's
  p full stages (keeping each W right after its B instead gives (p−1)·T).

- **DualPipeV** (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.2.1, Fig. 5; the V form of DualPipe, as
  torch's ScheduleDualPipeV): the same V placement, steady state in (F, B) pairs of opposite chunks whose compute
  and communication overlap on a GPU. With no overlap to gain (this simulator, one CPU core per rank) its step is
  m(T_F+T_B+T_W) + (p−1)·T/2 at equal costs, as ZB-V's, and its excess over the work does not depend on m; over
  the grid tested it is no longer than ZB-V's whenever T_B < T_F or T_B <= T_W, and can be longer where B
  dominates (1:2:1 from p = 3 on: its full backwards keep B and W together where ZB-V holds W's back).
  No closed form for other ratios is derived here: simulate it. Each rank holds at most 2p+1 chunk activations
  (ZB-V's 2p, and one more: in a pair the forward runs before the backward frees its micro-batch).

`zb_makespan` / `zb_bubble_formula` (in schedules.py, with chapter 09's formulas, where the planner reads them) give
these; `build_any_schedule` builds every schedule of chapters 09 and 15.
"""

from __future__ import annotations

from minidist.parallel.pp.schedules import (
    ALL_SCHEDULES,
    COMPUTE,
    V_SCHEDULES,
    ZB_SCHEDULES,
    Action,
    B,
    F,
    W,
    build_schedule,
    check_schedule_args,
    rank_chunks,
    with_communication,
    zb_bubble_formula,
    zb_makespan,
)

# The formulas live beside chapter 09's in schedules.py (the planner reads them there) and are offered here too.
__all__ = ["zb1_order", "zbv_order", "dualpipev_order", "check_any_schedule_args", "chunks_per_rank",
           "build_any_schedule",
           "zb_makespan", "zb_bubble_formula"]


def zb1_order(pp: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1: rank r runs 1F1B's warm-up (p−1−r forwards), then F and B alternately with each W r micro-batches
    behind its B; in the cool-down each B is followed by the oldest W owed, and the rest of the W's close."""
    m = microbatches
    orders = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        order = [Action(F, i, r) for i in range(warmup)]
        owed: list[int] = []
        for i in range(m):
            if warmup + i < m:
                order.append(Action(F, warmup + i, r))
            order.append(Action(B, i, r))
            owed.append(i)
            if warmup + i >= m or len(owed) > r:  # steady state: keep r W's owed; cool-down: pay one per B
                order.append(Action(W, owed.pop(0), r))
        order += [Action(W, i, r) for i in owed]
        orders.append(order)
    return orders


def zbv_order(pp: int, microbatches: int) -> list[list[Action]]:
    """ZB-V: on rank r, `down` = chunk r (first leg), `up` = chunk 2p−1−r (second leg).

    Warm-up: 2(p−r)−1 forwards down; r pairs (forward up, forward down); then p−r rounds of forward up followed at
    once by its B and W up (the bottom of the V turns each micro-batch round without waiting). Steady state: a
    forward down (while any are left), B and W down, a forward up, B and W up. Cool-down: the remaining B's, down
    and up alternately; rank r keeps 2r W's owed (a W runs after a B only beyond that), and pays them last: a W
    never waits, so it fills a gap the B's leave.
    """
    return [_zbv_rank(pp, microbatches, r) for r in range(pp)]


def _zbv_rank(p: int, m: int, r: int) -> list[Action]:
    down, up = rank_chunks(r, p, v_shape=True)
    count = {(F, down): 0, (F, up): 0, (B, down): 0, (B, up): 0}
    order: list[Action] = []

    def run(kind: str, chunk: int, with_w: bool = False) -> None:
        mb = count[(kind, chunk)]
        count[(kind, chunk)] += 1
        order.append(Action(kind, mb, chunk))
        if with_w:
            order.append(Action(W, mb, chunk))

    for _ in range(2 * (p - r) - 1):
        run(F, down)
    for _ in range(r):
        run(F, up)
        run(F, down)
    for _ in range(p - r):
        run(F, up)
        run(B, up, with_w=True)
    while count[(F, up)] < m:
        if count[(F, down)] < m:
            run(F, down)
        run(B, down, with_w=True)
        run(F, up)
        run(B, up, with_w=True)
    while count[(B, down)] < m or count[(B, up)] < m:
        for chunk in (down, up):
            if count[(B, chunk)] < m:
                run(B, chunk, with_w=True)
    return _hold_back_ws(order, 2 * r)


def dualpipev_order(pp: int, microbatches: int) -> list[list[Action]]:
    """DualPipeV: DeepSeek-V3's DualPipe folded into a V (chunks r and 2p−1−r on rank r, as ZB-V), in the action
    order of torch.distributed.pipelining's ScheduleDualPipeV. Its steady state pairs a forward of one chunk with a
    backward of the other (F down + B up, F up + B down); on a GPU each pair overlaps one's compute with the other's
    communication, here the two run one after another (as torch's overlapped sub-actions do on CPU). A full
    backward is B with its W right after; in the drain, from the middle of rank r's last r+1 pairs of B's on, W is
    held back and paid one per B down, the rest last."""
    return [_dualpipev_rank(pp, microbatches, r) for r in range(pp)]


def _dualpipev_rank(p: int, m: int, r: int) -> list[Action]:
    down, up = rank_chunks(r, p, v_shape=True)
    count = {(F, down): 0, (F, up): 0, (B, down): 0, (B, up): 0}
    order: list[Action] = []
    owed: list[Action] = []

    def run(kind: str, chunk: int, hold_w: bool = False) -> None:
        mb = count[(kind, chunk)]
        count[(kind, chunk)] += 1
        order.append(Action(kind, mb, chunk))
        if kind == B:
            (owed if hold_w else order).append(Action(W, mb, chunk))

    for _ in range(2 * (p - r - 1)):  # the first leg fills the V below this rank
        run(F, down)
    for _ in range(r + 1):
        run(F, down)
        run(F, up)
    for _ in range(p - r - 1):  # the bottom of the V turns: gradients start coming up
        run(B, up)
        run(F, up)
    for _ in range(m - 2 * p + r + 1):  # steady state: two (F, B) pairs of opposite chunks
        run(F, down)
        run(B, up)
        run(F, up)
        run(B, down)
    for _ in range(p - r - 1):
        run(B, up)
        run(F, up)
        run(B, down)
    hold = False
    for i in range(r + 1):  # the drain: from the middle on, W's are held back to fill the waits
        hold = hold or (i == (r + 1) // 2 and r % 2 == 1)
        run(B, up, hold)
        hold = hold or (i == (r + 1) // 2 and r % 2 == 0)
        run(B, down, hold)
    for _ in range(p - r - 1):
        if owed:
            order.append(owed.pop(0))
        run(B, down, True)
    return order + owed


def _hold_back_ws(order: list[Action], hold: int) -> list[Action]:
    """The same order, but after the last forward each B's W waits until more than `hold` are owed; the owed W's
    close the step."""
    last_f = max(i for i, a in enumerate(order) if a.kind == F)
    out, owed = order[:last_f + 1], []
    for a in order[last_f + 1:]:
        if a.kind == B:
            out.append(a)
            owed.append(Action(W, a.mb, a.chunk))
            while len(owed) > hold:
                out.append(owed.pop(0))
    return out + owed


def check_any_schedule_args(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> None:
    """One-line ValueError unless (schedule, p, m, v) make a schedule of chapter 09 or 15."""
    if schedule not in ZB_SCHEDULES:
        if schedule not in ALL_SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; choose one of {ALL_SCHEDULES}")
        check_schedule_args(schedule, pp, microbatches, virtual_stages)
        return
    check_schedule_args("1f1b", pp, microbatches, 1)  # positive integers
    if schedule in V_SCHEDULES:
        if virtual_stages not in (1, 2):
            raise ValueError(f"{schedule} places exactly two chunks per rank itself; drop --virtual-stages "
                             f"{virtual_stages} (or use --schedule interleaved)")
        if microbatches < 2 * pp:
            raise ValueError(f"{schedule} needs microbatches >= 2*pp, got microbatches={microbatches} < {2 * pp}; "
                             f"use microbatches >= {2 * pp}, or schedule 'zb1'")
        return
    if virtual_stages != 1:
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule='interleaved' (zb1 runs one chunk per "
                         "rank); use --virtual-stages 1, or --schedule zbv for two chunks per rank")
    if microbatches < pp:
        raise ValueError(f"zb1 needs microbatches >= pp, got microbatches={microbatches} < pp={pp}; "
                         f"use microbatches >= {pp}, or schedule '1f1b'")


def chunks_per_rank(schedule: str, virtual_stages: int = 1) -> int:
    """How many chunks each rank holds: 2 under the V placement (implied), else `virtual_stages`."""
    return 2 if schedule in V_SCHEDULES else virtual_stages


def build_any_schedule(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> list[list[Action]]:
    """Every rank's ordered actions, communication included, for any schedule of chapters 09 and 15."""
    check_any_schedule_args(schedule, pp, microbatches, virtual_stages)
    if schedule == "zb1":
        return with_communication(zb1_order(pp, microbatches), pp)
    if schedule in V_SCHEDULES:
        order = zbv_order if schedule == "zbv" else dualpipev_order
        return with_communication(order(pp, microbatches), pp, 2)
    return build_schedule(schedule, pp, microbatches, virtual_stages)


def fused_backwards(actions: list[Action]) -> set[tuple[int, int]]:
    """The (micro-batch, chunk) whose W is the very next compute action after its B on this rank (DualPipeV's full
    backwards, a drained ZB-V's tail): nothing runs between them, so one backward does both, without recording the
    gradients at the weight branches for a second walk (the same gradients, bit for bit: `split_backward`)."""
    compute = [a for a in actions if a.kind in COMPUTE]
    return {(b.mb, b.chunk) for b, w in zip(compute, compute[1:])
            if b.kind == B and w.kind == W and (w.mb, w.chunk) == (b.mb, b.chunk)}
