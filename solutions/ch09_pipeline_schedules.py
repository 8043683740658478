"""Chapter 09 exercises, answered: 1F1B with its messages, and the breadth-first (looped) pipeline schedule, as
lists of `minidist.parallel.pp.schedules.Action`s.

1F1B: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM",
§2.2.1 (PipeDream-Flush). Breadth-first: Lamy-Poirier 2023, "Breadth-First Pipeline Parallelism" (MLSys): with v
chunks per rank, run every micro-batch through one chunk before moving to the next, forward and backward.
"""

from minidist.parallel.pp.schedules import RECV_B, RECV_F, SEND_B, SEND_F, Action


def _forward(mb: int, chunk: int, last: int) -> list[Action]:
    """A forward with its messages: receive the input (not chunk 0), compute, send the output (not the last)."""
    return ([Action(RECV_F, mb, chunk)] if chunk > 0 else []) + [Action("F", mb, chunk)] + (
        [Action(SEND_F, mb, chunk)] if chunk < last else [])


def _backward(mb: int, chunk: int, last: int) -> list[Action]:
    """A backward with its messages: receive the output's gradient (not the last chunk), compute, send the input's
    gradient back (not chunk 0)."""
    return ([Action(RECV_B, mb, chunk)] if chunk < last else []) + [Action("B", mb, chunk)] + (
        [Action(SEND_B, mb, chunk)] if chunk > 0 else [])


def one_f_one_b_schedule(pp: int, microbatches: int) -> list[list[Action]]:
    """1F1B for p ranks and m micro-batches, messages included (see exercises/ch09_pipeline_schedules.py)."""
    last = pp - 1
    schedule = []
    for r in range(pp):
        warmup = min(pp - r - 1, microbatches)
        actions = []
        for i in range(warmup):
            actions += _forward(i, r, last)
        for i in range(microbatches - warmup):
            actions += _forward(warmup + i, r, last) + _backward(i, r, last)
        for i in range(microbatches - warmup, microbatches):
            actions += _backward(i, r, last)
        schedule.append(actions)
    return schedule


def looped_afab_schedule(pp: int, microbatches: int, virtual_stages: int) -> list[list[Action]]:
    """Breadth-first: every micro-batch through each of the rank's chunks in turn, then back (see exercises)."""
    last = pp * virtual_stages - 1
    schedule = []
    for r in range(pp):
        chunks = [j * pp + r for j in range(virtual_stages)]
        actions = []
        for c in chunks:
            for i in range(microbatches):
                actions += _forward(i, c, last)
        for c in reversed(chunks):
            for i in range(microbatches):
                actions += _backward(i, c, last)
        schedule.append(actions)
    return schedule
