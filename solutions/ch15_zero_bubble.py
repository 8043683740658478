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

from collections import deque

import torch
from torch.autograd.graph import GradientEdge, Node

from minidist.parallel.pp.schedules import RECV_B, RECV_F, SEND_B, SEND_F, Action, B, F, W


class DeferredWeightLinear(torch.autograd.Function):
    """y = x·Wᵀ + b; backward: dx = dy·W now, (dy, x) queued for W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, pending: list) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.params, ctx.pending = (weight, bias), pending
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        ctx.pending.append((dy, x, *ctx.params))  # W needs dy and x (and where to put the result)
        return dy @ weight, None, None, None


def run_weight_grads(pending: list) -> None:
    """dW = Σ over leading dims of dyᵀ·x, db = Σ dy, accumulated into .grad."""
    while pending:
        dy, x, weight, bias = pending.pop(0)
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        for param, grad in ((weight, dy2.t() @ x2), (bias, dy2.sum(0))):
            param.grad = grad if param.grad is None else param.grad + grad


def _ancestors(root: Node, target: Node) -> tuple[set[Node], dict[Node, list[Node]]]:
    """The nodes from which `target` is reached (the input's path), and each node's parents (towards the root)."""
    parents: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is not None:
                if child not in parents:
                    parents[child] = []
                    queue.append(child)
                parents[child].append(node)
    path, queue = {target}, deque([target])
    while queue:
        for parent in parents.get(queue.popleft(), []):
            if parent not in path:
                path.add(parent)
                queue.append(parent)
    return path, parents


def _leaf_node(t: torch.Tensor) -> Node:
    return t.view_as(t).grad_fn.next_functions[0][0]  # a leaf's AccumulateGrad


def frontier_backward_input(output: torch.Tensor, grad: torch.Tensor, x: torch.Tensor,
                            weights: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
    """B: dx, and what W needs: {frontier node: (the gradients it received in B, its branch's weights)}."""
    path, parents = _ancestors(output.grad_fn, _leaf_node(x))
    captured: dict = {}
    for w in weights:  # up each weight's branch to the first node on the input's path: its frontier node
        seen, queue = set(), deque([_leaf_node(w)])
        while queue:
            for parent in parents.get(queue.popleft(), []):
                if parent in path:
                    captured.setdefault(parent, [None, []])[1].append(w)
                elif parent not in seen:
                    seen.add(parent)
                    queue.append(parent)

    def record(node: Node):
        def hook(grad_outputs):
            captured[node][0] = grad_outputs
        return hook

    handles = [node.register_prehook(record(node)) for node in captured]
    try:
        (dx,) = torch.autograd.grad([output], [x], [grad], retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    return dx, captured


def frontier_backward_weight(captured: dict) -> None:
    """W: one backward per frontier node, from the gradients it received in B, into its own branch's weights."""
    for node, (received, weights) in captured.items():
        edges = [(GradientEdge(node, i), g) for i, g in enumerate(received) if g is not None]
        torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=weights, retain_graph=True)


def zb1_schedule(pp: int, microbatches: int) -> list[list[Action]]:
    """Rank r: 1F1B's warm-up; each B followed by the W of r micro-batches before (the oldest owed); in the
    cool-down one W after each B; the owed W's last."""
    m, last = microbatches, pp - 1
    schedule = []
    for r in range(pp):
        warmup = min(pp - 1 - r, m)
        compute = [(F, i) for i in range(warmup)]
        owed: list[int] = []
        for i in range(m):
            if warmup + i < m:
                compute.append((F, warmup + i))
            compute.append((B, i))
            owed.append(i)
            if warmup + i >= m or len(owed) > r:
                compute.append((W, owed.pop(0)))
        compute += [(W, i) for i in owed]
        order: list[Action] = []
        for kind, i in compute:
            if kind == F:
                order += [Action(RECV_F, i, r)] if r > 0 else []
                order += [Action(F, i, r)] + ([Action(SEND_F, i, r)] if r < last else [])
            elif kind == B:
                order += [Action(RECV_B, i, r)] if r < last else []
                order += [Action(B, i, r)] + ([Action(SEND_B, i, r)] if r > 0 else [])
            else:
                order.append(Action(W, i, r))
        schedule.append(order)
    return schedule


def v_chunk_rank(chunk: int, pp: int) -> int:
    return chunk if chunk < pp else 2 * pp - 1 - chunk


def v_rank_chunks(rank: int, pp: int) -> list[int]:
    return [rank, 2 * pp - 1 - rank]


def local_boundaries(pp: int) -> list[tuple[int, int]]:
    return [(pp - 1, pp)]  # the bottom of the V: rank p−1 holds chunks p−1 and p
