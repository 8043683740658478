"""minidist's pipeline schedules (parallel/pp/) beside `torch.distributed.pipelining`'s, on the same stages.

    minidist    torch.distributed.pipelining     chunks per rank
    1f1b        Schedule1F1B                      1
    interleaved ScheduleInterleaved1F1B           v (a loop: chunk c on rank c mod p)
    zbv         ScheduleZBVZeroBubble             2 in a V (rank r: chunks r and 2p-1-r)
    dualpipev   ScheduleDualPipeV                 2 in a V

Both sides are schedules as data: minidist's `build_any_schedule` lists `Action(kind, mb, chunk)` per rank, torch's
schedule object its `pipeline_order` ({rank: [_Action(stage, type, mb) or None]}). `compute_actions` writes both
in one notation, "F3c1" (forward of micro-batch 3 through chunk 1), "B", "W", so they can be compared line by line.
torch calls the input-gradient half of a split backward "I" and the whole backward "B"; minidist calls the first
"B" when a "W" follows: both are written B here, and in a schedule that splits the backward (zbv, dualpipev) torch's
whole backward is written as its two halves, B then W at once. DualPipeV's overlapped forward-backward pairs are
flattened into their two actions, and torch's bubbles (None) are dropped.
"""

from __future__ import annotations

import torch
from torch import nn

from minidist.model import Transformer
from minidist.parallel.pp.pipeline import partition_model
from minidist.parallel.pp.zero_bubble import build_any_schedule

TORCH_SCHEDULES = {"afab": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
                   "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
CHUNKS_PER_RANK = {"afab": 1, "1f1b": 1, "interleaved": 2, "zbv": 2, "dualpipev": 2}
TORCH_KINDS = {"F": "F", "B": "B", "I": "B", "W": "W"}


class TorchChunk(nn.Module):
    """Chunk c of p·v chunks of a minidist model as a module for torch's `PipelineStage`: tensor in, tensor out
    (the logits on the last chunk); the model's own forward runs it."""

    def __init__(self, model: Transformer, chunk: int, n_chunks: int) -> None:
        super().__init__()
        self.part = partition_model(model, chunk, n_chunks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.part.forward_chunk(self.part.pp_rank, x)


def torch_schedule(schedule: str, model: Transformer, chunks: list[int], pp: int, microbatches: int, group,
                   loss_fn, device: torch.device):
    """(torch's schedule object, the chunk modules) for this rank's `chunks` of `model` under `schedule`."""
    import torch.distributed.pipelining as pipelining

    n_chunks = pp * CHUNKS_PER_RANK[schedule]
    modules = nn.ModuleList(TorchChunk(model, c, n_chunks) for c in chunks)
    stages = [pipelining.PipelineStage(m, c, n_chunks, device, group=group) for m, c in zip(modules, chunks)]
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    multi = CHUNKS_PER_RANK[schedule] > 1
    return cls(stages if multi else stages[0], microbatches, loss_fn=loss_fn), modules


def action_name(kind: str, mb: int, chunk: int) -> str:
    return f"{kind}{mb}c{chunk}"


def torch_actions(pipeline_order: dict[int, list], split_backward: bool = False) -> list[list[str]]:
    """Each rank's compute actions of a torch schedule's `pipeline_order`, in order, in the common notation
    (`split_backward`: a whole backward written as B and W, as in minidist's zero-bubble schedules)."""
    out = []
    for rank in sorted(pipeline_order):
        names = []
        for action in pipeline_order[rank]:
            for a in (action.sub_actions or (action,)) if action is not None else ():
                kind = TORCH_KINDS.get(a.computation_type.value)
                if kind is not None:
                    names.append(action_name(kind, a.microbatch_index, a.stage_index))
                if split_backward and a.computation_type.value == "B":
                    names.append(action_name("W", a.microbatch_index, a.stage_index))
        out.append(names)
    return out


def minidist_actions(schedule: str, pp: int, microbatches: int) -> list[list[str]]:
    """Each rank's compute actions of minidist's schedule, in order, in the common notation."""
    v = CHUNKS_PER_RANK[schedule] if schedule == "interleaved" else 1
    plan = build_any_schedule(schedule, pp, microbatches, v)
    return [[action_name(a.kind, a.mb, a.chunk) for a in rank if a.kind in ("F", "B", "W")] for rank in plan]


def first_difference(ours: list[str], theirs: list[str]) -> tuple[int, str | None, str | None] | None:
    """(position, minidist's action, torch's) where two action lists first differ; None when equal."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i, a, b
    if len(ours) != len(theirs):
        i = min(len(ours), len(theirs))
        return i, ours[i] if i < len(ours) else None, theirs[i] if i < len(theirs) else None
    return None
