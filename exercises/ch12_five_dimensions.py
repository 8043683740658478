"""Chapter 12 exercises: the rank grid of five dimensions — where a rank sits and who shares each group with it —
and the memory a rank holds: model states under ZeRO with experts, and the activations a 1F1B pipeline keeps.

Grade your answers with `make grade CH=12`. The grader compares with `minidist.comm.topology` (coordinates, groups),
`minidist.plan.rank_memory` (model states) and `minidist.parallel.pp.schedules` (the 1F1B schedule itself), on the
chapter's 16-rank grid (pp 2, dp 2, cp 2, tp 2, ep 2) and random grids.

The grid (chapter 12 §1): ranks sit on (pp, dp, cp, tp), row-major, tp fastest:
rank = ((pp_i·dp + dp_i)·cp + cp_i)·tp + tp_i. The data-parallel replicas are the dp·cp ranks with the same pp and
tp indices, numbered dp_cp = dp_i·cp + cp_i; ep is carved out of them, ep fastest: dp_cp = edp_i·ep + ep_i.

linear_training_seconds is graded against `minidist.plan.gemm_table` (`training_gemms`, the FLOP-weighted rate)
with a rate that differs for every shape, so that a transposed gradient GEMM shows.

block_activation_bytes is graded against tensor accounting: the bytes autograd really saves in one of
minidist's dense blocks (`minidist.memory.PeakSavedBytes`), for several shapes; its tp and sequence-parallel cases
against `minidist.plan.rank_memory.layer_activation_bytes`, which the package's own tests measure on real ranks.
"""

from __future__ import annotations

from collections.abc import Callable


def rank_coordinates(rank: int, dp: int, tp: int, pp: int, cp: int, ep: int) -> dict[str, int]:
    """A rank's index along every dimension: a dict with keys "pp", "dp", "cp", "tp", "dp_cp", "ep", "edp".

    Undo the row-major numbering from the fastest dimension outwards, or from the slowest inwards with divmod:
    rank 13 of the chapter's grid (pp = dp = cp = tp = ep = 2) is pp 1 (13 // 8), then 5 within the stage: dp 1
    (5 // 4), then 1: cp 0, tp 1. Its replica index is dp_cp = dp_i·cp + cp_i = 2, so ep_i = 2 % 2 = 0 and
    edp_i = 2 // 2 = 1.
    Hint: why tp fastest? tp talks several times per layer, so its ranks must be neighbours (the GPUs of a node).
    """
    raise NotImplementedError("exercise: divmod from the slowest dimension (pp) to the fastest (tp), then split dp_cp")


def group_members(rank: int, name: str, dp: int, tp: int, pp: int, cp: int, ep: int) -> list[int]:
    """The sorted global ranks in `rank`'s group along `name`, one of "pp", "dp", "cp", "tp", "dp_cp", "ep", "edp".

    A group of a dimension is the set of ranks that agree with `rank` on every *other* coordinate. For the single
    dimensions that is simple: rank 13's tp group is [12, 13]. The combined ones: dp_cp (the replicas that average
    dense gradients) lets dp and cp both vary; ep (the ranks that exchange tokens by all-to-all) is ep consecutive
    members of a dp_cp group — those with the same edp index; edp (the ranks holding the same experts, which
    average the expert gradients) is the members of the dp_cp group with the same ep index. On the chapter's grid
    rank 13's dp_cp group is [9, 11, 13, 15], its ep group [13, 15], its edp group [9, 13].
    Hint: compare `rank_coordinates` of every rank with rank's on the coordinates the group keeps fixed. Careful
    with the derived ones: dp_cp, ep and edp change whenever dp or cp does, so a dp group must not require equal
    dp_cp; only ep and edp groups fix one half of the dp_cp split (edp for ep, ep for edp).
    """
    raise NotImplementedError("exercise: the ranks whose coordinates match rank's outside the group's dimensions")


def model_state_bytes(n_dense: int, n_experts: int, dp_cp: int, ep: int, zero: int, param_bytes: int = 2,
                      grad_bytes: int = 2, optimizer_bytes: int = 12) -> dict[str, float]:
    """Bytes of "params", "grads" and "optimizer" state on one rank (a dict of floats).

    The rank holds n_dense dense parameters (its tp shard of its pp stage: replicated over the dp_cp replicas) and
    n_experts expert parameters (its block of N/ep experts: replicated over edp = dp_cp / ep ranks). Each
    parameter costs param_bytes + grad_bytes + optimizer_bytes (defaults: ZeRO §3.1's mixed precision, bf16 weights
    and gradients, fp32 master copy and Adam's two moments: 2 + 2 + 12 = 16 bytes). ZeRO (chapter 07) divides by
    the number of replicas: from stage 1 the optimizer state, from stage 2 the gradients too, at stage 3 the
    parameters as well. Example: n_dense = 1,000, n_experts = 4,000, dp_cp = 4, ep = 2, zero = 1: the optimizer
    holds 12·1,000/4 + 12·4,000/2 = 27,000 bytes; the parameters 2·5,000 = 10,000.
    Hint: the two kinds have different replica groups; a classic slip divides the experts by dp_cp too.
    """
    raise NotImplementedError("exercise: each kind's bytes, divided by its replica count where ZeRO shards them")


def in_flight_1f1b(pp: int, microbatches: int, stage: int) -> int:
    """How many micro-batches' activations pipeline rank `stage` (0 = first) holds at once under 1F1B.

    1F1B (chapter 09) runs pp − stage − 1 warm-up forwards, then alternates one forward and one backward: a
    micro-batch's activations live from its forward to its backward. Count the forwards done and backwards not
    yet done at the worst moment. The first stage holds the most, which is why the memory model (and the planner)
    checks it; with fewer micro-batches than stages, there are only that many to hold. AFAB (GPipe) would hold all
    of them.
    Hint: the answer is a one-liner; the grader checks it against the schedule minidist executes.
    """
    raise NotImplementedError("exercise: the warm-up forwards plus the one in the steady state, capped by m")


def block_activation_bytes(tokens: int, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, d_ff: int,
                           p: int = 4, tp: int = 1, sp: bool = False, recompute: str = "none") -> float:
    """Bytes one dense block (RMSNorm → grouped-query attention with RoPE → residual, RMSNorm → SwiGLU → residual)
    keeps for its backward, for `tokens` tokens on this rank (a micro-batch's B·s/cp: context parallelism only
    divides the tokens), activations of p bytes per element (4: fp32; the norms' statistics stay fp32).

    Derive it op by op, as chapter 12 §3 does: for each op of the block's forward (minidist/model/layers.py,
    attention.py), which of its inputs or outputs does its backward need? A linear needs its input; an
    elementwise product both factors; the fused attention kernel q, k, v, its output and one fp32 number per
    (token, head) — what one is that? With tensor parallelism (Megatron's column/row split, chapter 08) each rank
    holds n_heads/tp query heads, max(n_kv_heads/tp, 1) key/value heads and d_ff/tp hidden units; with sequence
    parallelism (Korthikanti et al. 2022, §4.2.2) the parts outside the tp regions — the norms — hold only
    tokens/tp tokens, while a linear's gathered input is still whole. recompute="full" keeps only each block's
    input (the residual stream entering it; on the sequence shard under SP); the rest is rebuilt in the backward.

    Check yourself before the grader does: build a one-layer model, run its block under PeakSavedBytes, compare.
    """
    raise NotImplementedError("exercise: op by op, the tensors the block's backward needs")


def linear_training_seconds(forward: list[tuple[int, int, int, float]], rate_of: Callable[[int, int, int], float],
                            recompute: bool = False) -> float:
    """Seconds of a layer's linear GEMMs in one training step, each GEMM at the rate its own shape runs.

    `forward` lists the layer's forward GEMMs on one rank as (m, k, n, count): `count` products of an m×k input (m
    rows: the micro-batch's tokens) by a k×n weight. `rate_of(m, k, n)` is the FLOP/s a GEMM of an m×k by a k×n
    matrix reaches (a measured table, chapter 12 "Matmul rates by shape"); a GEMM of that shape does 2·m·k·n FLOPs.
    Training runs more than the forward: for Y = X·W, the backward computes the input's gradient dX = dY·Wᵀ and the
    weight's gradient dW = Xᵀ·dY. Write each as (rows, reduction, columns) from the shapes of its two factors —
    which one reduces over the tokens? Full recomputation (`recompute`) runs every forward GEMM a second time.
    Sum each GEMM's FLOPs over its own rate: averaging the rates instead would weight a small, slow GEMM as much as
    a large, fast one.
    """
    raise NotImplementedError("exercise: the forward, dX and dW of each GEMM, each at its own shape's rate")
