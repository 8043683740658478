"""What context parallelism sends and computes, from the formulas notebook 10 derives: the ledger of a run must
equal `expected_cp_traffic` exactly, and the kernels' score counters `unmasked_scores`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from minidist.comm.communicator import ring_bytes_sent
from minidist.model.config import ModelConfig
from minidist.parallel.cp.core import kv_heads_per_rank
from minidist.parallel.cp.sharding import shard_positions


def attention_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(query/key head size, value head size) of the tensors the attention core sees."""
    if cfg.attention == "mla":
        return cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim, cfg.mla.v_head_dim
    return cfg.head_dim, cfg.head_dim


def kv_width(cfg: ModelConfig, tp: int = 1) -> int:
    """Values in one token's keys and values on a tp rank: what context parallelism moves and all-gather keeps."""
    d_qk, d_v = attention_dims(cfg)
    return kv_heads_per_rank(cfg, tp) * (d_qk + d_v)


def gathered_kv_bytes(cfg: ModelConfig, tokens: int, tp: int, cp: int, impl: str, element_size: int) -> int:
    """Bytes one block keeps beyond its own `tokens` under all-gather context parallelism: the other cp − 1 ranks'
    keys and values, for its backward (0 for the ring, Ulysses or cp 1)."""
    if impl != "allgather" or cp == 1:
        return 0
    return element_size * tokens * kv_width(cfg, tp) * (cp - 1)


def expected_cp_traffic(cfg: ModelConfig, impl: str, batch: int, seq_len: int, cp: int, tp: int = 1,
                        layers: Sequence[int] | None = None, rank: int = 0, element_size: int = 4,
                        recomputed: bool = False) -> dict[tuple[str, str], dict[str, int]]:
    """{(op, "cp"): {"calls", "bytes"}} one cp rank records in one forward + backward of the blocks `layers` (their
    indices; default all), `batch` sequences of `seq_len` tokens, q/k/v of `element_size` bytes; `recomputed`: each
    block's forward runs again in the backward (full recomputation), its forward's traffic with it.

    Per layer, with |K|, |V| this rank's keys and values (B · H_kv · T/cp · d each):
      ring       send: forward (cp−1)(|K|+|V|); backward (cp−1)(|K|+|V|) + cp(|dK|+|dV|), accumulators fp32 at least
      allgather  all_gather of K and V forward, reduce_scatter of their gradients backward: (cp−1)/cp of the whole
                 sequence's K and V each
      ulysses    all_to_all of q, k, v and the output forward, of their gradients backward: (cp−1)/cp of each
                 local tensor; kv heads fewer than cp are first replicated to cp
    and per MoE block, forward: an all_reduce of the [batch, n_experts] int64 routing counts (the balance loss).
    """
    blocks = range(cfg.n_layers) if layers is None else list(layers)
    moe_blocks = sum(cfg.moe.n_experts > 0 and i >= cfg.moe.first_dense_layers for i in blocks)
    layers = len(blocks)
    if cp == 1:
        return {}
    d_qk, d_v = attention_dims(cfg)
    heads, kv = cfg.n_heads // tp, kv_heads_per_rank(cfg, tp)
    local = seq_len // cp
    k_bytes, v_bytes = batch * kv * local * d_qk * element_size, batch * kv * local * d_v * element_size
    counts: dict[tuple[str, str], dict[str, int]] = {}

    def add(op: str, nbytes: int, calls: int) -> None:
        entry = counts.setdefault((op, "cp"), {"calls": 0, "bytes": 0})
        entry["calls"] += calls * layers
        entry["bytes"] += nbytes * layers

    forwards = 2 if recomputed else 1
    if impl == "ring":
        acc = max(element_size, 4)
        add("send", forwards * (cp - 1) * (k_bytes + v_bytes), forwards * 2 * (cp - 1))
        add("send", (cp - 1) * (k_bytes + v_bytes) + cp * (k_bytes + v_bytes) * acc // element_size,
            2 * (cp - 1) + 2 * cp)  # backward: the blocks again, and the gradient accumulators
    elif impl == "allgather":
        for d in (d_qk, d_v):
            whole = (seq_len, batch, kv, d)
            add("all_gather", forwards * ring_bytes_sent("all_gather", whole, element_size, cp, rank), forwards)
            add("reduce_scatter", ring_bytes_sent("reduce_scatter", whole, element_size, cp, rank), 1)
    elif impl == "ulysses":
        kv = max(kv, cp)
        tensors = [heads * d_qk, kv * d_qk, kv * d_v, heads * d_v]  # q, k, v, output: per token
        for width in tensors:
            nbytes = batch * local * width * element_size
            add("all_to_all", (forwards + 1) * (nbytes - nbytes // cp), forwards + 1)  # forward(s), gradient
    else:
        raise ValueError(f"unknown context-parallel implementation {impl!r}")
    if moe_blocks:
        entry = counts.setdefault(("all_reduce", "cp"), {"calls": 0, "bytes": 0})
        entry["calls"] += forwards * moe_blocks
        entry["bytes"] += forwards * moe_blocks * ring_bytes_sent("all_reduce", (batch, cfg.moe.n_experts), 8, cp, rank)
    return dict(sorted(counts.items()))


def unmasked_scores(seq_len: int, cp: int, rank: int, layout: str) -> int:
    """(query, key) pairs the causal mask leaves to rank `rank`: Σ over its query positions p of (p + 1)."""
    return int((shard_positions(seq_len, rank, cp, layout) + 1).sum())


def score_balance(seq_len: int, cp: int, layout: str) -> float:
    """max / min over the ranks of `unmasked_scores`: 1 for zig-zag; for contiguous 1 + 2(cp−1)·c/(c+1) with
    c = T/cp, which tends to 2·cp − 1 as c grows."""
    counts = torch.tensor([unmasked_scores(seq_len, cp, r, layout) for r in range(cp)], dtype=torch.float64)
    return (counts.max() / counts.min()).item()
