"""Where a pipeline rank's blocks sit and how many of its forwards are alive at once: the two facts of a schedule the
memory model (`rank_memory`) and the step time (`step_time`) read.

* Placement (chapter 09, chapter 15): `virtual_stages` chunks per rank in a loop (chunk c on rank c mod p), or, under
  ZB-V and DualPipeV, two chunks per rank in a V (rank r holds chunks r and 2p − 1 − r, so rank 0 holds the
  embedding and the head). `stage_kinds` counts the dense and MoE blocks a rank holds.
* In flight: the most (micro-batch, chunk) forwards whose backward has not run, counted on the schedule itself
  (`zero_bubble.build_any_schedule`) where a closed form is not known: p − r for 1F1B, m·v for AFAB, Megatron's
  warm-up for the interleaved schedule; a zero-bubble forward lives until its W.
"""

from __future__ import annotations

import functools

from minidist.model.config import ModelConfig
from minidist.parallel.pp.pipeline import chunk_layers
from minidist.parallel.pp.schedules import V_SCHEDULES, ZB_SCHEDULES, B, F, W, chunk_rank, rank_chunks
from minidist.parallel.pp.zero_bubble import build_any_schedule, chunks_per_rank
from minidist.plan.schedule_costs import PLATEAU


@functools.lru_cache(maxsize=64)
def placement(schedule: str, virtual_stages: int) -> tuple[int, bool]:
    """(chunks per rank, whether they sit in a V): zbv and dualpipev place two chunks per rank themselves, rank r
    holding chunks r and 2p−1−r (so rank 0 holds the first and the last: the embedding and the head); the other
    schedules `virtual_stages` chunks in a loop (chunk c on rank c mod p)."""
    return chunks_per_rank(schedule, virtual_stages), schedule in V_SCHEDULES


def head_stage(schedule: str, pp: int) -> int:
    """The pipeline rank that holds the last chunk (the final norm, the head and the loss): p − 1 in a loop, 0 in a
    V (`schedules.chunk_rank`)."""
    chunks, v_shape = placement(schedule, 1)  # in a loop the last chunk is on rank p − 1 whatever v
    return chunk_rank(chunks * pp - 1, pp, v_shape)


@functools.lru_cache(maxsize=65536)
def _stage_layers(n_layers: int, pp: int, virtual_stages: int, stage: int, v_shape: bool = False) -> tuple[int, ...]:
    """The layer indices pipeline rank `stage` holds (all its chunks)."""
    chunks = chunk_layers(n_layers, pp, virtual_stages)
    return tuple(i for c in rank_chunks(stage, pp, virtual_stages, v_shape) for i in chunks[c])


def stage_kinds(cfg: ModelConfig, pp: int, virtual_stages: int, stage: int, schedule: str = "1f1b") -> tuple[int, int]:
    """(dense blocks, MoE blocks) pipeline rank `stage` holds under `schedule`'s placement."""
    v, v_shape = placement(schedule, virtual_stages)
    return _stage_kinds(cfg.n_layers, first_moe_layer(cfg), pp, v, stage, v_shape)


def first_moe_layer(cfg: ModelConfig) -> int:
    """The index of the first MoE block (n_layers for a dense model)."""
    return cfg.moe.first_dense_layers if cfg.moe.n_experts else cfg.n_layers


def busiest_stage_kinds(cfg: ModelConfig, pp: int, virtual_stages: int, schedule: str = "1f1b") -> tuple[int, int]:
    """(dense blocks, MoE blocks) of the pipeline rank with the most blocks, the most MoE blocks among those: the
    one whose per-block communication sets the pace."""
    v, v_shape = placement(schedule, virtual_stages)
    return _busiest(cfg.n_layers, first_moe_layer(cfg), pp, v, v_shape)


@functools.lru_cache(maxsize=65536)
def _busiest(n_layers: int, first_moe: int, pp: int, virtual_stages: int, v_shape: bool) -> tuple[int, int]:
    kinds = (_stage_kinds(n_layers, first_moe, pp, virtual_stages, s, v_shape) for s in range(pp))
    return max(kinds, key=lambda k: (sum(k), k[1]))


@functools.lru_cache(maxsize=65536)
def _stage_kinds(n_layers: int, first_moe: int, pp: int, virtual_stages: int, stage: int,
                 v_shape: bool = False) -> tuple[int, int]:
    layers = _stage_layers(n_layers, pp, virtual_stages, stage, v_shape)
    moe = sum(i >= first_moe for i in layers)
    return len(layers) - moe, moe


@functools.lru_cache(maxsize=4096)
def chunks_in_flight(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1, stage: int = 0) -> int:
    """The most (micro-batch, chunk) forwards whose backward has not run yet, on pipeline rank `stage`."""
    if pp == 1:
        return 1  # micro-batches run one after the other: one forward's activations at a time
    if schedule == "afab":
        return microbatches * virtual_stages
    if schedule == "1f1b":
        return min(microbatches, pp - stage)
    if schedule == "interleaved":
        # Megatron's interleaved warm-up, 2(p − r − 1) + (v − 1)·g forwards (g: the first group's micro-batches, p
        # when p divides m), then one more before the first backward (Narayanan et al. 2021, §2.2;
        # tests/test_memory_estimate.py checks it against the built schedules): the search asks this for millions
        # of micro-batches, which are not worth building
        first_group = -(-microbatches // (microbatches // pp)) if microbatches >= pp else microbatches  # the largest
        return min(2 * (pp - stage - 1) + (virtual_stages - 1) * first_group + 1, microbatches * virtual_stages)
    if schedule in ZB_SCHEDULES:  # the peaks stop growing: one build serves every larger m
        microbatches = min(microbatches, PLATEAU * pp)
    return built_in_flight(schedule, pp, microbatches, virtual_stages)[stage]


@functools.lru_cache(maxsize=1024)
def built_in_flight(schedule: str, pp: int, microbatches: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Every rank's most chunk-forwards alive at once, counted on the built schedule (`build_any_schedule`): a
    forward lives until its backward, or its W where the schedule splits the backward (the tensors W needs, the
    rest of the forward's with them in this trainer). `chunks_in_flight` asks it for at most `schedule_costs.PLATEAU`·p
    micro-batches of a zero-bubble schedule (its peaks no longer grow), so a search over millions costs one build."""
    peaks = []
    for actions in build_any_schedule(schedule, pp, microbatches, virtual_stages):
        release = W if any(a.kind == W for a in actions) else B  # zero-bubble: a forward's tensors live until W
        live = peak = 0
        for action in actions:
            if action.kind in (F, release):
                live += 1 if action.kind == F else -1
                peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


