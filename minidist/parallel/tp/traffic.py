"""The communication of one tensor-parallel forward + backward, from the formulas (notebook 08 derives them); the
tests compare it with the ledger of a real run."""

from __future__ import annotations

from collections.abc import Callable

from minidist.comm.communicator import ring_bytes_sent
from minidist.model.config import ModelConfig


def expected_tp_traffic(cfg: ModelConfig, batch: int, seq_len: int, tp: int, sequence_parallel: bool = False,
                        compute_bytes: int = 4, reduce_bytes: int | None = None,
                        rank: int = 0) -> dict[tuple[str, str], dict[str, int]]:
    """{(op, "tp"): {"calls", "bytes"}} one tp rank records for one forward + backward + vocab-parallel loss.

    Per block, the two regions (attention, MLP) each cost one entry and one exit, in both directions; the
    embedding's exit, the lm_head's entry and the loss's two small all-reduces come once. Element sizes: the
    row-parallel partial sums are in the compute dtype (`compute_bytes`: 2 under bf16 autocast) and are summed in
    `reduce_bytes` (default: the same; 4 with reduce_dtype=float32); everything else (the residual stream that
    enters a region and its gradient, the embedding, the loss statistics, parameter gradients) is fp32, because
    parameters are fp32 and autocast lowers only the matmuls.
    """
    counts: dict[tuple[str, str], dict[str, int]] = {}

    def add(op: str, shape: tuple[int, ...], element_size: int, calls: int = 1) -> None:
        entry = counts.setdefault((op, "tp"), {"calls": 0, "bytes": 0})
        entry["calls"] += calls
        entry["bytes"] += calls * ring_bytes_sent(op, shape, element_size, tp, rank)

    reduce_bytes = reduce_bytes or compute_bytes
    act = (seq_len, batch, cfg.d_model)
    n_tokens = batch * seq_len
    L = cfg.n_layers
    moe = L - cfg.moe.first_dense_layers if cfg.moe.n_experts else 0  # MoE blocks: whole, no MLP region
    exits, entries = 2 * L - moe, 2 * L + 1 - moe  # entries: attention, dense MLP, and the lm_head
    if sequence_parallel:
        add("reduce_scatter", act, reduce_bytes, exits)  # exit, forward
        add("all_gather", act, compute_bytes, exits)  # exit, backward
        add("all_gather", act, 4, entries)  # entry, forward
        add("reduce_scatter", act, 4, entries)  # entry, backward
        add("reduce_scatter", act, 4)  # embedding, forward
        add("all_gather", act, 4)  # embedding, backward
        add("all_gather", act, 4, 2 * moe)  # an MoE layer's input forward, its output's gradient backward
    else:
        add("all_reduce", act, reduce_bytes, exits)  # g, forward
        add("all_reduce", act, 4, entries)  # f, backward
        add("all_reduce", act, 4)  # embedding's g, forward
    add("all_reduce", (n_tokens,), 4)  # loss: max of the logits
    add("all_reduce", (2, n_tokens), 4)  # loss: sum of exponentials and the target logit, together
    _add_parameter_sums(add, cfg, tp, sequence_parallel, moe)
    return dict(sorted(counts.items()))


def _add_parameter_sums(add: Callable[..., None], cfg: ModelConfig, tp: int, sequence_parallel: bool,
                        moe: int) -> None:
    """The gradient sums of replicated parameters each tp rank uses on different data (`moe`: the MoE blocks)."""
    L = cfg.n_layers
    if cfg.attention == "gqa" and cfg.n_kv_heads % tp and tp > 1:  # replicated kv heads: wk, wv (biases) summed
        kv_rows = cfg.n_kv_heads * cfg.head_dim
        add("all_reduce", (kv_rows, cfg.d_model), 4, 2 * L)
        if cfg.bias:
            add("all_reduce", (kv_rows,), 4, 2 * L)
    if cfg.attention == "mla" and tp > 1:  # the latent path's weights, used by this rank's heads only
        m = cfg.mla
        add("all_reduce", (m.kv_lora_rank + m.qk_rope_head_dim, cfg.d_model), 4, L)  # wkv_a
        add("all_reduce", (m.kv_lora_rank,), 4, L)  # kv_norm
        if m.q_lora_rank is not None:
            add("all_reduce", (m.q_lora_rank, cfg.d_model), 4, L)  # wq_a
            add("all_reduce", (m.q_lora_rank,), 4, L)  # q_norm
    if sequence_parallel:  # norm gains (and biases), row-parallel biases, positions: seen on a sequence shard
        norm_params = 2 if (cfg.norm == "layernorm" and cfg.bias) else 1
        add("all_reduce", (cfg.d_model,), 4, (2 * L + 1) * norm_params)
        if cfg.bias:
            add("all_reduce", (cfg.d_model,), 4, 2 * L - moe)
        if cfg.position == "learned":
            add("all_reduce", (cfg.max_seq_len, cfg.d_model), 4)
