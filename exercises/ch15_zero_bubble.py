"""Chapter 15 exercises: the backward split in two, and zero-bubble schedules as data.

Grade your answers with `make grade CH=15`. Four exercises:

1. `DeferredWeightLinear`: y = x·Wᵀ + b as an autograd function whose backward computes only dx (B) and leaves
   dW and db for later (W), in `run_weight_grads`. The grader checks B and W against autograd's fused backward on
   2-D and 3-D inputs and that no weight gradient exists between B and W.
2. `frontier_backward_input` / `frontier_backward_weight`: the split of a whole block (two linears and a
   nonlinearity) on autograd by capturing the gradients at the frontier nodes, bit for bit equal to the fused
   backward, with no node of the input's path run twice.
3. `zb1_schedule(pp, m)`: ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §3.1) as a list of
   `Action`s per rank, messages included, W actions apart from B. The grader plays it with the chapter's simulator
   (`minidist.parallel.pp.schedules.simulate`, which raises on a deadlock or on a W before its B), checks the step
   time m(T_F+T_B+T_W) + (p−1)(T_F+T_B−T_W) for T_W <= T_F, and that no rank holds more than p micro-batches
   between their F and their W. Calling or importing minidist's schedule builders is refused.
4. `v_chunk_rank(chunk, pp)` / `v_rank_chunks(rank, pp)` / `local_boundaries(pp)`: the V placement of ZB-V and
   DualPipeV, 2p chunks on p ranks.

The format is chapter 09's (minidist/parallel/pp/schedules.py), with one more kind: W(mb, c), the weight gradients
of micro-batch mb on chunk c, after B(mb, c) on the same rank; W sends and receives nothing.
"""

from __future__ import annotations

import torch

from minidist.parallel.pp.schedules import Action


class DeferredWeightLinear(torch.autograd.Function):
    """y = x·Wᵀ + b whose backward (B) returns the gradient of x only and appends what W needs to `pending`.

    Usage: `y = DeferredWeightLinear.apply(x, weight, bias, pending)` with `pending` a list; after the backward,
    `run_weight_grads(pending)` accumulates dW and db into `weight.grad` and `bias.grad` (adding to what is
    there). x may have any number of leading dimensions ([B, d_in] or [B, T, d_in]).

    Which tensors does each half need? dx needs dy and W; dW needs dy and x. Save for W what W needs, not more.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, pending: list) -> torch.Tensor:
        raise NotImplementedError("exercise: the forward, saving what B needs and keeping what W needs")

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        raise NotImplementedError("exercise: dx only; queue W's work; None for the weight, bias and pending")


def run_weight_grads(pending: list) -> None:
    """W: for each entry B queued (oldest first), accumulate dW = dyᵀ·x and db = Σ dy over every leading
    dimension into `.grad`; empty `pending`.

    dy is [..., d_out] and x is [..., d_in] with the same leading dimensions: treat every leading position as one
    row of a matrix. A weight that already has a gradient (an earlier micro-batch) gets this one added, as autograd
    would accumulate it. Each entry runs exactly once."""
    raise NotImplementedError("exercise: the weight and bias gradients from the queued dy and x")


def frontier_backward_input(output: torch.Tensor, grad: torch.Tensor, x: torch.Tensor,
                            weights: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """B of a block by frontier capture: return (dx, captured), where `captured` holds what W will need.

    The block is two linears and a nonlinearity (y = lin2(act(lin1(x))), possibly with an identity in between that
    counts its backward runs, as a tensor-parallel all-reduce would): `output` is its output, `grad` the gradient
    of the output, `x` its input (a leaf that requires grad), `weights` every parameter of the block.

    Chapter 15 §2: the nodes from which x's accumulate-grad node can be reached form the *input's path*; a
    *frontier* node is a node on that path with an edge into a branch that leads only to weights (here: each
    linear's matmul node, whose other edges lead to its weight and bias). Walk the graph from `output.grad_fn`
    (each node's `next_functions`), find the input's path, then climb from each weight's accumulate-grad node to
    the first nodes on the path: its frontier nodes. Register a pre-hook on each frontier node
    (`node.register_prehook`) that records the gradients it receives, run `torch.autograd.grad` for x only — with
    `retain_graph=True`, or W will find the graph freed — and remove the hooks. B must not touch any weight's
    `.grad`: autograd computes no output that no edge needs, so the matmul nodes compute dx but not dW.

    Return `captured` in any form you like (e.g. {frontier node: (received gradients, its weights)}): the grader
    hands it to `frontier_backward_weight` unopened.

    Hints: a leaf's accumulate-grad node is `t.view_as(t).grad_fn.next_functions[0][0]`; keep a parents map while
    walking down, to climb back up.
    """
    raise NotImplementedError


def frontier_backward_weight(captured: dict) -> None:
    """W of the block: accumulate every weight's gradient into `.grad` from what `frontier_backward_input` captured.

    Start from the frontier nodes, not from the output: `torch.autograd.backward` accepts
    `torch.autograd.graph.GradientEdge(node, i)` as a tensor, with the gradient node's output i received in B.
    Run one backward call per frontier node, with `inputs=` the weights of that node's branch only: a call from the
    second linear's frontier with every weight as inputs would walk down the input's path (through the
    nonlinearity and the counting identity) into the first linear's weight again, counting its gradient twice.
    Keep `retain_graph=True` (a later call may need nodes this one ran). Add to `.grad` (autograd does): a weight
    may hold an earlier micro-batch's gradient. The result must equal the fused backward's bit for bit: each node
    runs once, on the same inputs.
    """
    raise NotImplementedError


def zb1_schedule(pp: int, microbatches: int) -> list[list[Action]]:
    """ZB-H1 for p ranks and m >= p micro-batches: each rank's F, B and W actions with every message in place.

    Start from 1F1B (chapter 09): p−r−1 warm-up forwards on rank r, then one forward and one backward alternately,
    then the remaining backwards. B now only produces the gradient the previous rank waits for; W can wait. How
    many W's may rank r hold back so that they fill its cool-down waits without raising its memory above p
    micro-batches in flight (from F to W)? When must the held-back W's run?
    """
    raise NotImplementedError("exercise: 1F1B with B and W apart, W's held back to fill the drain")


def v_chunk_rank(chunk: int, pp: int) -> int:
    """The rank that holds `chunk` (0 .. 2p−1) under the V placement: down the ranks, then back up.

    The model is cut into 2p chunks. The first p go to ranks 0, 1, .., p−1 as in a plain pipeline; the next p come
    back up, so that the last chunk (the head and the loss) lands on rank 0 beside the first (the embedding).
    Compare with the loop placement of interleaved 1F1B (chunk c on rank c mod p)."""
    raise NotImplementedError("exercise: the V placement")


def v_rank_chunks(rank: int, pp: int) -> list[int]:
    """The two chunks rank `rank` holds, in model order.

    The inverse of `v_chunk_rank`: every chunk c with v_chunk_rank(c, pp) == rank, smallest first. Check it on
    paper for p = 2 (chunks 0..3) and p = 4 (chunks 0..7): which rank holds two neighbouring chunks, and which rank
    holds the two ends of the model?"""
    raise NotImplementedError("exercise: the V placement, the other way round")


def local_boundaries(pp: int) -> list[tuple[int, int]]:
    """Every chunk boundary (c, c+1) whose two chunks are on the same rank: handed over without a message.

    A micro-batch's hidden state crosses each boundary forward (and its gradient backward). Where both chunks sit
    on one rank the executor hands the tensor over in memory, and the p2p program posts nothing for it: list those
    boundaries, as (c, c+1) pairs, for any p >= 1."""
    raise NotImplementedError("exercise: where the V turns")
