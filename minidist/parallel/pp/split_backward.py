"""The backward of a pipeline chunk in two halves (chapter 15): B, the gradient of the chunk's input, and W, the
gradients of its weights.

For a linear y = x·Wᵀ with upstream gradient dy: dx = dy·W needs W and dy, dW = dyᵀ·x needs the saved x and dy. The
two products are independent, so the previous stage can get dx (B) at once while dW (W) waits to fill a bubble
(Qi et al. 2023, "Zero Bubble Pipeline Parallelism", §2). Two ways to split a whole chunk on autograd:

- **The simple way** (`backward_input_simple`, `backward_weight_simple`): B is `autograd.grad` with respect to the
  input with `retain_graph=True`; W is a second backward from the outputs with respect to the weights. W walks the
  graph again: every node on the input's path runs twice, custom functions (tensor parallelism's f/g, their
  collectives) included, so W costs about T_B + T_W.
- **Capturing the frontier** (`backward_input`, `backward_weight`), the idea of torch.distributed.pipelining's
  `stage_backward_input`/`stage_backward_weight`, written here from scratch: B runs only the nodes on the input's
  path (autograd computes no output an edge does not need, so a matmul node computes dx but not dW), and a pre-hook
  on each *frontier* node (a node on the input's path with an edge into a weights-only branch) records the gradient
  it received. W starts from those recorded gradients and runs only the weights' branches: the frontier nodes again
  (this time for their weight outputs) and the nodes between them and the weights. Nothing on the input's path is
  recomputed; the sum of B and W is the fused backward, node for node, so gradients agree bit for bit.

A custom autograd function computes all its input gradients whenever it runs (its `needs_input_grad` is fixed at
forward), so a frontier node of one would do B's and W's work twice. One that declares `splits_by_phase` (the FP8
linear) is told which half it runs: B and W set `split_phase` ("input", "weight") on its node, which is its context.
Any other (a compiled region is one: AOTAutograd's one node per graph, which computes the weights' gradients with
the input's) runs once, in B, which keeps what it gave each weight branch (a post-hook); W hands that on without
running it again (`_whole`): B then carries its weight gradients, W what lies outside it. Under a zero-bubble
schedule the trainer runs the blocks' weight GEMMs outside the compiled graphs (`train.blocks.keep_gemms_eager`),
so W still holds them.

W accumulates through `torch.autograd.backward(..., inputs=weights)`, so the weights' accumulate-grad hooks fire as
in a fused backward (data parallelism's bucketed reductions start from them). The graph, and every tensor it saved,
stays alive until W (`retain_graph`): the pipeline's activation accounting releases a micro-batch at its W.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch._functorch.config as functorch_config
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


def grad_node(t: torch.Tensor) -> Node:
    """The autograd node a tensor's gradient enters: its grad_fn, or for a leaf its accumulate-grad node."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        raise ValueError("a tensor that does not require grad has no autograd node")
    return t.view_as(t).grad_fn.next_functions[0][0]  # a leaf's AccumulateGrad exists only through a use


def _graph(roots: Sequence[Node]) -> dict[Node, list[Node]]:
    """Every node reachable from `roots`, with the nodes that feed it a gradient (its parents, towards the roots)."""
    parents: dict[Node, list[Node]] = {node: [] for node in roots}
    queue = deque(roots)
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _ancestors(targets: Sequence[Node], parents: dict[Node, list[Node]]) -> set[Node]:
    """The nodes from which a target can be reached (the targets included): the path of the input's gradient."""
    seen = {t for t in targets if t in parents}
    queue = deque(seen)
    while queue:
        for parent in parents[queue.popleft()]:
            if parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen


@dataclass
class _Group:
    """Weights that share frontier nodes, and the frontier nodes W starts from: one backward call in W."""

    weights: list[torch.Tensor] = field(default_factory=list)
    frontier: dict[Node, None] = field(default_factory=dict)  # an ordered set: the same order on every run


@dataclass
class WeightWork:
    """What B leaves for W: each group's frontier, the gradients the frontier nodes received during B, and the
    output edges whose gradient was given (chunk outputs off the input's path: chunk 0 has no input gradient)."""

    groups: list[_Group]
    received: dict[Node, tuple[torch.Tensor | None, ...]]
    given: dict[Node, list[tuple[GradientEdge, torch.Tensor]]]
    produced: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)  # whole nodes' outputs
    branch: set[Node] = field(default_factory=set)  # the nodes off the input's path (the weights' branches)


def _whole(node: Node) -> bool:
    """A node that computes all its input gradients whenever it runs: a custom autograd function (a compiled
    region is one) that does not split them by phase (`splits_by_phase`)."""
    forward_cls = getattr(node, "_forward_cls", None)
    return forward_cls is not None and not getattr(forward_cls, "splits_by_phase", False)


def _weight_groups(parents: dict[Node, list[Node]], input_path: set[Node], roots: set[Node]) -> list[_Group]:
    """Group the weights reached from the outputs by the frontier nodes their branches hang from."""
    groups: list[_Group] = []
    owner: dict[Node, _Group] = {}  # frontier node -> its group
    for node in parents:
        weight = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf's gradient lands here
        if weight is None or node in input_path:
            continue
        frontier, seen, queue = {}, {node}, deque([node])
        while queue:  # up the weights-only branch until the input's path (or an output off it)
            current = queue.popleft()
            if current in roots and current not in input_path:
                frontier[current] = None
            for parent in parents[current]:
                if parent in input_path:
                    frontier[parent] = None
                elif parent not in seen:
                    seen.add(parent)
                    queue.append(parent)
        merged = [g for g in {id(owner[f]): owner[f] for f in frontier if f in owner}.values()]
        group = merged[0] if merged else _Group()
        for other in merged[1:]:  # branches that share a frontier node run in one backward call
            group.weights += other.weights
            group.frontier.update(other.frontier)
            groups.remove(other)
        group.weights.append(weight)
        group.frontier.update(frontier)
        for f in group.frontier:
            owner[f] = group
        if not merged:
            groups.append(group)
    return groups


def backward_input(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor | None], WeightWork]:
    """B: the gradients of `inputs` (leaves that require grad; may be empty) from `outputs` and their gradients
    (None: ones, for a loss); no weight gradient. Returns them and the `WeightWork` that `backward_weight` runs."""
    grads = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, grads)]
    root_nodes = [grad_node(o) for o in outputs]
    parents = _graph(root_nodes)
    input_path = _ancestors([grad_node(x) for x in inputs], parents)
    groups = _weight_groups(parents, input_path, set(root_nodes))
    given: dict[Node, list[tuple[GradientEdge, torch.Tensor]]] = {}
    for o, g in zip(outputs, grads):
        if grad_node(o) not in input_path:
            given.setdefault(grad_node(o), []).append((get_gradient_edge(o), g))
    received: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    hooked = {f for group in groups for f in group.frontier if f in input_path}

    def record(node: Node):
        def hook(grad_outputs: tuple[torch.Tensor | None, ...]) -> None:
            received[node] = grad_outputs
        return hook

    produced: dict[Node, tuple[torch.Tensor | None, ...]] = {}

    def keep(node: Node):
        def hook(grad_inputs: tuple[torch.Tensor | None, ...], _: tuple) -> None:
            produced[node] = grad_inputs
        return hook

    handles = [node.register_prehook(record(node)) for node in hooked]
    handles += [node.register_hook(keep(node)) for node in hooked if _whole(node)]
    _set_phase(hooked, "input")
    try:
        on_path = [(o, g) for o, g in zip(outputs, grads) if grad_node(o) in input_path]
        if inputs and on_path:
            with keeping_graph():
                dinputs = list(torch.autograd.grad([o for o, _ in on_path], list(inputs), [g for _, g in on_path],
                                                   retain_graph=True, allow_unused=True))
        else:
            dinputs = [None] * len(inputs)
    finally:
        for handle in handles:
            handle.remove()
        _set_phase(hooked, "weight")  # the next run of these nodes is W's
    return dinputs, WeightWork(groups, received, given, produced, set(parents) - input_path if produced else set())


def keeping_graph() -> contextlib.AbstractContextManager:
    """Around a backward with `retain_graph=True` through compiled regions: AOTAutograd refuses one where it
    compiled donated buffers (saved tensors a fused backward may overwrite with its outputs), unless its switch,
    `torch._functorch.config.donated_buffer`, is off while it runs; a kept graph's backward is then compiled
    without them (torch picks the variant by `retain_graph`)."""
    return functorch_config.patch(donated_buffer=False)


def _set_phase(nodes: set[Node], phase: str | None) -> None:
    """Tell the custom nodes that split their own gradients (`splits_by_phase`) which half of the backward runs."""
    for node in nodes:
        if getattr(getattr(node, "_forward_cls", None), "splits_by_phase", False):
            node.split_phase = phase


def backward_weight(work: WeightWork,
                    quiet: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> None:
    """W: accumulate the weights' gradients into `.grad` from what B recorded, one backward call per group.

    Every call but the last runs inside `quiet()`: a data-parallel engine that starts its reduction at the end of a
    backward (`DataParallel.no_sync`) must see the last call only, once every group has accumulated."""
    calls = []
    for group in work.groups:
        edges, grads = [], []
        for node in group.frontier:
            for edge, g in work.given.get(node, []):
                edges.append(edge)
                grads.append(g)
            if node in work.produced:  # ran whole in B: its gradients go on into the weights' branches
                for (child, nr), g in zip(node.next_functions, work.produced[node]):
                    if child is not None and g is not None and child in work.branch:
                        edges.append(GradientEdge(child, nr))
                        grads.append(g)
                continue
            for i, g in enumerate(work.received.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        if edges:
            calls.append((group, edges, grads))
    for index, (group, edges, grads) in enumerate(calls):
        # A frontier node downstream of another in the same group would also receive the upstream one's
        # contribution again: pin every frontier node's incoming gradient to what it received in B.
        handles = [node.register_prehook(lambda _, g=work.received[node]: g)
                   for node in group.frontier if len(group.frontier) > 1 and node in work.received]
        try:
            with quiet() if index < len(calls) - 1 else contextlib.nullcontext(), keeping_graph():
                torch.autograd.backward(edges, grads, retain_graph=True, inputs=group.weights)
        finally:
            for handle in handles:
                handle.remove()
    _set_phase({node for group in work.groups for node in group.frontier}, None)
    work.groups, work.received, work.given, work.produced, work.branch = [], {}, {}, {}, set()  # the graph goes


def backward_input_simple(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                          inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """B the simple way: the input gradients, keeping the whole graph for a second walk in W."""
    if not inputs:
        return []
    with keeping_graph():
        return list(torch.autograd.grad(list(outputs), list(inputs), list(grads), retain_graph=True,
                                        allow_unused=True))


def backward_weight_simple(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None],
                           weights: Sequence[torch.Tensor]) -> None:
    """W the simple way: a second backward from the outputs, accumulating into the weights only (the input's
    path runs again)."""
    torch.autograd.backward(list(outputs), list(grads), inputs=list(weights))
