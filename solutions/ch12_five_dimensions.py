"""Chapter 12 exercises (reference answers): the rank grid of five dimensions, and a memory estimate per rank:
model states, activations of one block, and the 1F1B pipeline's micro-batches in flight."""

from __future__ import annotations

from collections.abc import Callable


def rank_coordinates(rank: int, dp: int, tp: int, pp: int, cp: int, ep: int) -> dict[str, int]:
    """A rank's index along pp, dp, cp, tp and the derived dp_cp, ep, edp (see the exercise's docstring)."""
    pp_i, rest = divmod(rank, dp * cp * tp)
    dp_i, rest = divmod(rest, cp * tp)
    cp_i, tp_i = divmod(rest, tp)
    dp_cp = dp_i * cp + cp_i
    edp_i, ep_i = divmod(dp_cp, ep)
    return {"pp": pp_i, "dp": dp_i, "cp": cp_i, "tp": tp_i, "dp_cp": dp_cp, "ep": ep_i, "edp": edp_i}


def group_members(rank: int, name: str, dp: int, tp: int, pp: int, cp: int, ep: int) -> list[int]:
    """The sorted global ranks of `rank`'s group along `name`: the ranks that agree with it on every coordinate
    but the ones `name` varies."""
    # The grid's own coordinates a group keeps fixed; ep and edp additionally fix their index in the dp_cp split.
    fixed = {"pp": ("dp", "cp", "tp"), "dp": ("pp", "cp", "tp"), "cp": ("pp", "dp", "tp"), "tp": ("pp", "dp", "cp"),
             "dp_cp": ("pp", "tp"), "ep": ("pp", "tp", "edp"), "edp": ("pp", "tp", "ep")}[name]
    mine = rank_coordinates(rank, dp, tp, pp, cp, ep)
    return [other for other in range(dp * tp * pp * cp)
            if all(rank_coordinates(other, dp, tp, pp, cp, ep)[k] == mine[k] for k in fixed)]


def model_state_bytes(n_dense: int, n_experts: int, dp_cp: int, ep: int, zero: int, param_bytes: int = 2,
                      grad_bytes: int = 2, optimizer_bytes: int = 12) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state on one rank holding n_dense dense parameters (replicated
    over dp_cp) and n_experts expert parameters (replicated over dp_cp / ep), at ZeRO stage `zero`."""
    out = {"params": 0.0, "grads": 0.0, "optimizer": 0.0}
    for n, replicas in ((n_dense, dp_cp), (n_experts, dp_cp // ep)):
        out["params"] += param_bytes * n / (replicas if zero >= 3 else 1)
        out["grads"] += grad_bytes * n / (replicas if zero >= 2 else 1)
        out["optimizer"] += optimizer_bytes * n / (replicas if zero >= 1 else 1)
    return out


def in_flight_1f1b(pp: int, microbatches: int, stage: int) -> int:
    """Micro-batches whose activations pipeline rank `stage` holds at once under 1F1B."""
    return min(microbatches, pp - stage)


def block_activation_bytes(tokens: int, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, d_ff: int,
                           p: int = 4, tp: int = 1, sp: bool = False, recompute: str = "none") -> float:
    """Bytes a dense block saves for its backward (see the exercise's docstring)."""
    n, d = tokens, d_model
    shard = tp if sp and tp > 1 else 1  # the norms see tokens/tp tokens under sequence parallelism
    if recompute == "full":
        return p * n * d / shard  # only the block's input; everything else is rebuilt in the backward
    # RMSNorm: its fp32 input, 1/rms per token, the normalized x; its output is the next linear's (gathered) input.
    norm = (4 * n * d + 4 * n + p * n * d) / shard + p * n * d
    q = n_heads // tp * head_dim
    kv = max(n_kv_heads // tp, 1) * head_dim
    # q and k before RoPE (its backward needs cos/sin only, but the rotated copies are the kernel's inputs), q
    # rotated, k rotated, v; the kernel's output, the input of wo; and the fp32 log-sum-exp per (token, head).
    attention = p * n * (3 * q + 2 * kv) + 4 * n * (n_heads // tp)
    # SwiGLU: gate and up outputs (the product needs both), silu(gate), and the product (w_down's input).
    mlp = 4 * p * n * d_ff / tp
    return 2 * norm + attention + mlp


def linear_training_seconds(forward: list[tuple[int, int, int, float]], rate_of: Callable[[int, int, int], float],
                            recompute: bool = False) -> float:
    """Seconds of a layer's linear GEMMs in one training step, each at its shape's rate (see the exercise)."""
    seconds = 0.0
    for m, k, n, count in forward:
        passes = (((m, k, n), 2 if recompute else 1), ((m, n, k), 1), ((k, m, n), 1))
        for (a, b, c), times in passes:
            seconds += times * count * 2.0 * a * b * c / rate_of(a, b, c)
    return seconds
