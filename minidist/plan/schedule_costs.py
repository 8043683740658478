"""What a pipeline schedule costs in the planner (chapters 09 and 15): its bubble for a stage's T_F : T_B : T_W, and
the share of DualPipeV's work that runs in overlapped (F, B) pairs. Read off the schedules' own data (the builders
and the simulator of `minidist.parallel.pp`), each (p, m) class built once.

* T_F : T_B : T_W (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §2): a linear y = x·Wᵀ costs the same FLOPs
  three times, forward, input gradient (B: dy·W) and weight gradient (W: dyᵀ·x); the attention kernel's backward
  (twice its forward, `flops.attention_flops_per_token`) is all B (it has no weights). Full recomputation runs the
  forward again inside B; selective recomputation adds no matmul.
* Bubble: 1F1B / interleaved / AFAB by chapter 09's formulas; ZB-H1 and ZB-V by chapter 15's closed forms in
  T_F, T_B, T_W (`schedules.zb_makespan`); DualPipeV (no closed form away from equal costs) simulated on its built
  schedule with `PLATEAU`·p micro-batches: its fill and drain do not grow with m (the tests check it), so the
  excess over the work found there holds for every larger m; past `SIMULATED_UP_TO` ranks it grows linearly in p.
* Overlapped pairs (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.2.1): in DualPipe's steady state a forward
  of one chunk runs beside a backward of the other, each one's all-to-all and pipeline sends hidden behind the
  other's compute. A pair is a forward followed at once by a backward of the other chunk in a rank's compute order
  (torch's ScheduleDualPipeV runs exactly those as one overlapped action); the share of forwards so paired grows
  with m (the warm-up and the drain are unpaired), counted on the built schedule.
"""

from __future__ import annotations

import functools

from minidist.parallel.pp.schedules import COMPUTE, ZB_SCHEDULES, B, F, bubble_formula, simulate, zb_bubble_formula
from minidist.parallel.pp.zero_bubble import build_any_schedule, chunks_per_rank

# Past this many micro-batches per pipeline rank a zero-bubble schedule only lengthens its steady state (its fill,
# drain and peaks in flight stay as they are; the tests check it): DualPipeV is simulated and paired, and
# `stages.chunks_in_flight` counts the peaks, on the schedule built with at most this many.
PLATEAU = 2
SIMULATED_UP_TO = 16  # pipeline ranks; beyond, DualPipeV's excess grows by the same amount per rank (tests check it)


def split_costs(attention_share: float, recompute: str = "none") -> tuple[float, float, float]:
    """(T_F, T_B, T_W) as fractions of a stage's training FLOPs without recomputation (sum 1), `attention_share`
    of which are the attention kernel's (forward once, backward twice: all B)."""
    linear = (1.0 - attention_share) / 3
    t_f = linear + attention_share / 3
    t_b = linear + 2 * attention_share / 3 + (t_f if recompute == "full" else 0.0)
    return t_f, t_b, linear


def pipeline_bubble(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1,
                    costs: tuple[float, float, float] = (1.0, 1.0, 1.0)) -> float:
    """The idle fraction of a pipelined step: `costs` = (T_F, T_B, T_W) of one micro-batch on one rank, all its
    chunks together (only their ratios matter; chapter 09's schedules fuse B and W, so they ignore them)."""
    if pp == 1:
        return 0.0
    if schedule not in ZB_SCHEDULES:
        return bubble_formula(schedule, pp, microbatches, virtual_stages)
    t_f, t_b, t_w = (round(c / sum(costs), 2) for c in costs)  # a few classes of ratios (to 1%), cached
    if schedule == "dualpipev":
        excess = dualpipev_excess(pp, t_f, t_b, t_w)
        return excess / (microbatches * (t_f + t_b + t_w) + excess)
    return zb_bubble_formula(schedule, pp, microbatches, t_f, t_b, t_w)


def dualpipev_excess(pp: int, t_f: float, t_b: float, t_w: float) -> float:
    """DualPipeV's step less its work, for any m >= 2p: simulated with 2p micro-batches up to `SIMULATED_UP_TO`
    ranks, and beyond extended by the growth per rank found there (linear in p: the fill and the drain add the same
    per rank of depth)."""
    if pp <= SIMULATED_UP_TO:
        return _dualpipev_excess(pp, PLATEAU * pp, t_f, t_b, t_w)
    top = _dualpipev_excess(SIMULATED_UP_TO, PLATEAU * SIMULATED_UP_TO, t_f, t_b, t_w)
    below = _dualpipev_excess(SIMULATED_UP_TO - 1, PLATEAU * (SIMULATED_UP_TO - 1), t_f, t_b, t_w)
    return top + (top - below) * (pp - SIMULATED_UP_TO)


@functools.lru_cache(maxsize=4096)
def _dualpipev_excess(pp: int, microbatches: int, t_f: float, t_b: float, t_w: float) -> float:
    """The simulated step of DualPipeV less its work (each chunk costs half of a rank's T's)."""
    timeline = simulate(build_any_schedule("dualpipev", pp, microbatches), t_f / 2, t_b / 2, weight=t_w / 2)
    return timeline.makespan - microbatches * (t_f + t_b + t_w)


def paired_share(schedule: str, pp: int, microbatches: int) -> float:
    """The fraction of a rank's forwards (the fewest over ranks) that run in an overlapped pair with a backward of
    its other chunk: DualPipeV's; 0 for every other schedule (they run one action at a time)."""
    if schedule != "dualpipev" or pp == 1:
        return 0.0
    built = min(microbatches, PLATEAU * pp)
    unpaired = _unpaired_forwards(pp, built)  # the same for every m >= 2p: only the steady state grows
    return 1.0 - unpaired / (chunks_per_rank(schedule) * microbatches)


@functools.lru_cache(maxsize=1024)
def _unpaired_forwards(pp: int, microbatches: int) -> int:
    most = 0
    for actions in build_any_schedule("dualpipev", pp, microbatches):
        compute = [a for a in actions if a.kind in COMPUTE]
        pairs = sum(a.kind == F and b.kind == B and a.chunk != b.chunk for a, b in zip(compute, compute[1:]))
        most = max(most, sum(a.kind == F for a in compute) - pairs)
    return most
