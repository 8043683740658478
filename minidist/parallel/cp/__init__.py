"""Context parallelism (chapter 10): the sequence split over cp ranks, attention across them."""

from minidist.parallel.cp.allgather import allgather_attention
from minidist.parallel.cp.blockwise import Work, attend_block, attend_block_backward, blockwise_attention, merge
from minidist.parallel.cp.core import (
    IMPLS,
    LAYOUT_OF,
    ContextParallel,
    ContextParallelAttention,
    apply_context_parallel,
    attention_cores,
    validate_context_parallel,
)
from minidist.parallel.cp.ring import ring_attention
from minidist.parallel.cp.sharding import (
    LAYOUTS,
    shard_all,
    shard_positions,
    shard_sequence,
    unshard_all,
)
from minidist.parallel.cp.traffic import expected_cp_traffic, score_balance, unmasked_scores
from minidist.parallel.cp.ulysses import ulysses_attention

__all__ = [
    "IMPLS", "LAYOUTS", "LAYOUT_OF", "ContextParallel", "ContextParallelAttention", "Work", "allgather_attention",
    "apply_context_parallel", "attend_block", "attend_block_backward", "attention_cores", "blockwise_attention",
    "expected_cp_traffic", "merge", "ring_attention", "score_balance", "shard_all", "shard_positions",
    "shard_sequence", "ulysses_attention", "unmasked_scores", "unshard_all", "validate_context_parallel",
]
