"""The MoE layer (chapter 06): routed experts (+ shared experts) in place of a block's dense MLP, and the
boolean-mask reference its sorted dispatch must equal."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from minidist.model.config import ModelConfig
from minidist.model.layers import SwiGLU
from minidist.model.moe.dispatch import DispatchPlan, Experts, expert_capacity, plan_dispatch, swiglu
from minidist.model.moe.routing import Routing, at_least_fp32, route, router_z_loss, sequence_balance_losses

# What a layer sums over a step's training forwards, after its N routed-slot counts: the logged figures come
# from sums, which add up over micro-batches, replicas and stages.
STEP_FIELDS = ("dropped", "balance_sum", "sequences", "z_sum", "tokens")


class MoELayer(nn.Module):
    """Routed experts (+ optional shared experts) in place of a block's dense MLP; input and output [..., d_model].

    The input's second-to-last dimension is the sequence: [B, T, d] holds B sequences of T tokens ([T, d]: one).
    After each forward: `aux_loss` (scalar tensor, weighted) and `last_stats` (that forward's expert_load [N]
    fraction of routed slots, drop_rate, balance_loss, z_loss as floats). Buffers: `router_bias` [N] (persistent,
    changed only by `update_router_biases`), `tokens_per_expert` [N] (routed slots counted by training forwards
    since the last bias update) and `step_sums` [N + 5] (routed slots and the `STEP_FIELDS`, summed over training
    forwards since the last `moe_stats`). `layer_index` is the block's index in the model.
    """

    def __init__(self, cfg: ModelConfig, backend: str = "auto", layer_index: int = 0) -> None:
        super().__init__()
        moe = cfg.moe
        self.layer_index = layer_index
        self.n_experts = moe.n_experts
        self.top_k = moe.top_k
        self.router_kind = moe.router
        self.renormalize = moe.renormalizes()
        self.scaling = moe.routed_scaling_factor
        self.capacity_factor = moe.capacity_factor
        self.aux_loss_coef = moe.aux_loss_coef
        self.z_loss_coef = moe.z_loss_coef
        self.bias_update_speed = moe.bias_update_speed
        d_expert = moe.d_expert or cfg.d_ff
        self.router = nn.Linear(cfg.d_model, moe.n_experts, bias=False)
        self.experts = Experts(moe.n_experts, cfg.d_model, d_expert, backend)
        self.shared = SwiGLU(cfg.d_model, moe.n_shared_experts * d_expert) if moe.n_shared_experts else None
        self.register_buffer("router_bias", torch.zeros(moe.n_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(moe.n_experts), persistent=False)
        self.register_buffer("step_sums", torch.zeros(moe.n_experts + len(STEP_FIELDS), dtype=torch.float64),
                             persistent=False)
        self.aux_loss: torch.Tensor | None = None
        self._last: tuple | None = None  # the last forward's figures, on the device until `last_stats` reads them
        self.seq_reduce: Callable | None = None  # context parallelism: sums over the ranks holding each sequence
        self.counting = True  # False while activation recomputation replays a forward already counted

    def route(self, x: torch.Tensor) -> Routing:
        """Routing of rows x [T, d_model] in (at least) fp32 (Switch §2.4, "selective precision")."""
        logits = F.linear(at_least_fp32(x), at_least_fp32(self.router.weight))
        return route(logits, self.top_k, self.router_kind, self.router_bias, self.renormalize, self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        seq_len = shape[-2]
        x = x.reshape(-1, shape[-1])
        routing = self.route(x)
        capacity = expert_capacity(seq_len, self.n_experts, self.top_k, self.capacity_factor)
        # padded: no tensor sized by how many slots the capacity keeps (a host read of the count on a GPU)
        plan = plan_dispatch(routing.indices, routing.weights, self.n_experts, capacity, seq_len, padded=True)
        h = self.experts(x.index_select(0, plan.token), plan.counts, padded=capacity is not None)
        h = h * plan.gate.to(h.dtype).unsqueeze(-1)
        y = x.new_zeros(x.shape).index_add(0, plan.token, h)
        if self.shared is not None:
            y = y + self.shared(x)
        self._record(routing, plan, seq_len)
        return y.reshape(shape)

    def _record(self, routing: Routing, plan: DispatchPlan, seq_len: int) -> None:
        per_sequence = sequence_balance_losses(routing.probs, routing.indices, self.n_experts, seq_len, self.seq_reduce)
        balance = per_sequence.mean()
        z = router_z_loss(routing.logits)
        self.aux_loss = self.aux_loss_coef * balance + self.z_loss_coef * z
        routed = plan.routed.detach()
        tokens, slots = routing.indices.shape[0], routing.indices.numel()
        dropped = routed.sum() - plan.counts.sum()
        if self.training and self.counting:
            with torch.no_grad():
                self.tokens_per_expert += routed.to(self.tokens_per_expert.dtype)
                # In place, Python numbers as scalars: a tensor built on the host would be a copy the GPU waits on.
                sums, n = self.step_sums, self.n_experts
                sums[:n] += routed.to(sums)
                for i, value in enumerate((dropped, per_sequence.sum(), per_sequence.numel(), z * tokens, tokens)):
                    sums[n + i] += value  # STEP_FIELDS' order
        self._last = (routed, slots, dropped.detach(), balance.detach(), z.detach())

    @property
    def last_stats(self) -> dict | None:
        """The last forward's expert_load [N] (fraction of routed slots), drop_rate, balance_loss and z_loss as
        floats, read on the host when asked (the trainer logs `moe_stats` instead); None before a forward."""
        if self._last is None:
            return None
        routed, slots, dropped, balance, z = self._last
        return {"expert_load": (routed.float() / slots).cpu(), "drop_rate": int(dropped) / slots,
                "balance_loss": float(balance), "z_loss": float(z)}


class Replaying:
    """Within the block, the MoE layers inside `module` route without counting: the context of a recomputed forward
    (activation checkpointing runs a block's forward again in the backward; its routing was counted the first time).

    torch's non-reentrant checkpoint often stops the replay before the counts (once every saved tensor is rebuilt),
    but only by the order of the operations; this makes "count each routing once" a rule, not a coincidence. It can
    be entered again, nested or after an exit: when the backward's graph is walked twice (a zero-bubble schedule's B
    and W, chapter 15), the checkpoint recomputes the block once per walk."""

    def __init__(self, module: nn.Module) -> None:
        self.layers = [m for m in module.modules() if isinstance(m, MoELayer)]
        self.saved: list[list[bool]] = []  # the counting flags before each entry still open

    def __enter__(self) -> None:
        self.saved.append([m.counting for m in self.layers])
        for m in self.layers:
            m.counting = False

    def __exit__(self, *exc) -> None:
        for m, counting in zip(self.layers, self.saved.pop()):
            m.counting = counting


def moe_forward_naive(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The reference the sorted dispatch must equal: for each expert, a boolean mask of its token-slots.

    Capacity is applied GShard's way, per sequence: a cumulative sum of one-hot choices over each sequence's slots
    in (rank, position) order, so this checks `plan_dispatch` by an independent route. Sets no stats.
    """
    shape = x.shape
    seq_len = shape[-2]
    x = x.reshape(-1, shape[-1])
    routing = layer.route(x)
    num_tokens, k = routing.indices.shape
    keep = torch.ones_like(routing.indices, dtype=torch.bool)
    capacity = expert_capacity(seq_len, layer.n_experts, k, layer.capacity_factor)
    if capacity is not None:
        sequences = num_tokens // seq_len
        by_sequence = routing.indices.view(sequences, seq_len, k).transpose(1, 2).reshape(sequences, k * seq_len)
        one_hot = F.one_hot(by_sequence, layer.n_experts)  # [S, k·T, N], each sequence's slots in priority order
        position = (one_hot.cumsum(1) - 1) * one_hot  # how many earlier slots of the sequence chose the same expert
        keep = (position.sum(-1) < capacity).view(sequences, k, seq_len).transpose(1, 2).reshape(num_tokens, k)
    y = torch.zeros_like(x)
    for e, weights in enumerate(layer.experts.per_expert()):
        mask = (routing.indices == e) & keep  # [T, k]
        rows = mask.any(dim=-1)
        if rows.any():
            gate = (routing.weights * mask).sum(dim=-1)[rows]
            y[rows] += gate.to(x.dtype).unsqueeze(-1) * swiglu(x[rows], *weights)
    if layer.shared is not None:
        y = y + layer.shared(x)
    return y.reshape(shape)
