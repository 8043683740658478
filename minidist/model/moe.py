"""Mixture of experts on one device (chapter 06): routers, balancing losses, capacity, sorted dispatch.

A token goes to k of N expert MLPs chosen by a learned router, so the parameter count grows with N while the
compute per token grows only with k (Shazeer et al. 2017, "Outrageously Large Neural Networks").

Routers (`route`):
- "softmax": p = softmax(x W_r); the k largest p are chosen. top-1 keeps the gate p_i (Switch, Fedus et al. 2021);
  top-k > 1 renormalizes the chosen p to sum to 1 (Mixtral, Jiang et al. 2024: softmax over the top-k logits).
- "sigmoid": s = σ(x W_r); experts are chosen by s + b, where b is the auxiliary-loss-free bias, but the gates use
  s alone, renormalized over the chosen k and multiplied by routed_scaling_factor (DeepSeek-V3 2024, eq. 12-16).
Ties are broken deterministically: the lower expert index wins (a stable descending sort).

Balancing: `load_balancing_loss` (Switch, eq. 4-6, computed per sequence as DeepSeek-V3's sequence-wise loss,
eq. 17-20), `router_z_loss` (ST-MoE, Zoph et al. 2022, eq. 5) and the auxiliary-loss-free bias (Wang et al. 2024;
DeepSeek-V3 §2.1.2), updated by `update_router_biases`.

Capacity: each expert takes at most C = ⌈capacity_factor · T · k / N⌉ token-slots of each *sequence* of T tokens.
Priority inside a sequence is (choice rank, position): every first choice is served before any second choice, and
within one rank the earlier position wins — GShard's rule (Lepikhin et al. 2020, Algorithm 1), applied per sequence.
A dropped slot contributes zero; the residual connection carries the token. capacity_factor None: dropless.

Why per sequence (not per forward call, or per device as in GShard and Switch): parity. No layout but context
parallelism splits a sequence, so the dropped slots and the balance loss f·P (not linear in the tokens) are the
same in every layout; cp ranks would exchange small counts (see `plan_dispatch`, `sequence_balance_losses`).

Dispatch: slots are sorted by expert id (a stable argsort), gathered with index_select into one buffer where each
expert's tokens are a contiguous slice, run through the experts (a loop over experts, or torch._grouped_mm), and
summed back with index_add. `moe_forward_naive` is the boolean-mask loop it is checked against.

Trainer contract:
- `Transformer.aux_loss()` sums `MoELayer.aux_loss` (α·balance + z_coef·z, weighted) of the last forward; add it
  to the LM loss per micro-batch. Both are means (over sequences, over tokens): equal micro-batches and replicas
  average to the global batch's value.
- `moe_stats(model, reduce_fn)` after a step: balance figures of the training forwards since the previous call,
  from sums that `reduce_fn` adds over ranks, so every layout logs the figures of the whole global batch.
- `update_router_biases(model, reduce_fn)` after each optimizer step: b_i += γ·sign(mean_load − load_i) from the
  routed-slot counts of every training forward since the previous call, then resets them. Under data parallelism
  reduce_fn sums the counts over the replicas, so every replica applies the same update.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from minidist.model.config import ModelConfig
from minidist.model.layers import SwiGLU

# ----------------------------------------------------------------------------------------------------------------
# routing


@dataclass
class Routing:
    logits: torch.Tensor  # [T, N] fp32 router logits
    probs: torch.Tensor  # [T, N] per-token distribution over experts used by the balance loss (rows sum to 1)
    indices: torch.Tensor  # [T, k] chosen experts, best first (int64)
    weights: torch.Tensor  # [T, k] gates that multiply the chosen experts' outputs (fp32)


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def top_k_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest entries of each row, best first; equal scores: the lower index wins (torch.topk promises no
    order for ties, a stable sort does)."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def route(logits: torch.Tensor, top_k: int, router: str = "softmax", bias: torch.Tensor | None = None,
          renormalize: bool | None = None, scaling: float = 1.0) -> Routing:
    """Choose top_k experts per row of `logits` [T, N]; `bias` [N] shifts the choice but never the gates.

    Runs in at least float32 (float64 stays float64, for exact checks).
    """
    logits = _at_least_fp32(logits)
    if renormalize is None:
        renormalize = top_k > 1
    if router == "softmax":
        scores = logits.softmax(dim=-1)
        probs = scores
    elif router == "sigmoid":
        scores = torch.sigmoid(logits)
        # DeepSeek-V3's balance loss uses the scores normalized over all experts (eq. 19-20).
        probs = scores / scores.sum(dim=-1, keepdim=True)
    else:
        raise ValueError(f"router {router!r} is unknown; choose 'softmax' or 'sigmoid'")
    choice = scores if bias is None else scores + bias.to(scores.dtype)
    indices = top_k_indices(choice.detach(), top_k)
    weights = scores.gather(-1, indices)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(logits, probs, indices, weights * scaling)


# ----------------------------------------------------------------------------------------------------------------
# balancing losses


def sequence_balance_losses(router_probs: torch.Tensor, expert_indices: torch.Tensor, num_experts: int,
                            seq_len: int | None = None, reduce_counts: Callable | None = None) -> torch.Tensor:
    """N · Σᵢ fᵢ · Pᵢ of each sequence of `seq_len` consecutive tokens (default: all tokens are one sequence): [S].

    Switch's loss (Fedus et al. 2021, eq. 4-6) on the tokens of one sequence, i.e. DeepSeek-V3's sequence-wise
    balance loss (eq. 17-20). fᵢ = (token-slots routed to i) / (T · k): the fraction of the sequence's T·k routing
    decisions that chose i (counted before any capacity dropping), so Σ fᵢ = 1. Pᵢ = mean over its tokens of the
    router probability of i. Only P carries a gradient (f is a count).

    Context parallelism keeps it exact: `reduce_counts` sums each sequence's counts over its cp ranks (chapter 10).
    """
    probs = _at_least_fp32(router_probs.reshape(-1, num_experts))
    tokens = probs.shape[0]
    indices = expert_indices.reshape(tokens, -1)
    seq_len = seq_len or tokens
    sequences = tokens // seq_len
    # counts[s, i]: slots of sequence s routed to i, one bincount over the pairs (s, i) numbered s·N + i
    pair = indices.reshape(sequences, -1) + num_experts * torch.arange(sequences, device=indices.device)[:, None]
    counts = torch.bincount(pair.flatten(), minlength=sequences * num_experts).view(sequences, num_experts)
    counts = reduce_counts(counts) if reduce_counts is not None else counts  # a sequence split over cp ranks
    f = counts.to(probs.dtype) / counts.sum(dim=-1, keepdim=True)  # / (T·k)
    p = probs.reshape(sequences, seq_len, num_experts).mean(dim=1)
    return num_experts * (f * p).sum(dim=-1)


def load_balancing_loss(router_probs: torch.Tensor, expert_indices: torch.Tensor, num_experts: int,
                        seq_len: int | None = None) -> torch.Tensor:
    """The mean over sequences of `sequence_balance_losses`, unweighted: multiply by α. With seq_len None (all
    tokens one set) it is Switch's batch-wise loss.

    Uniform routing gives exactly 1; top-1 collapse onto one expert gives N; top-k routing concentrated on the
    same k experts gives N/k.
    """
    return sequence_balance_losses(router_probs, expert_indices, num_experts, seq_len).mean()


def router_z_loss(router_logits: torch.Tensor) -> torch.Tensor:
    """(1/B) Σ_tokens (log Σ_j exp x_j)² (Zoph et al. 2022, ST-MoE eq. 5): keeps router logits small."""
    logits = _at_least_fp32(router_logits.reshape(-1, router_logits.shape[-1]))
    return torch.logsumexp(logits, dim=-1).square().mean()


# ----------------------------------------------------------------------------------------------------------------
# capacity and dispatch


def expert_capacity(num_tokens: int, num_experts: int, top_k: int, capacity_factor: float | None) -> int | None:
    """⌈capacity_factor · tokens · k / experts⌉ token-slots per expert; None (dropless) when the factor is None.
    The layer passes the tokens of one sequence: the capacity is per expert and per sequence.

    The factor goes through a Fraction, so 1.1 · 100 / 10 is 11, not ⌈11.000000000000002⌉ = 12.
    """
    if capacity_factor is None:
        return None
    if not capacity_factor > 0:
        raise ValueError(f"capacity_factor must be > 0 (or None for dropless), got {capacity_factor}")
    exact = Fraction(capacity_factor).limit_denominator(10**6) * num_tokens * top_k / num_experts
    return math.ceil(exact)


@dataclass
class DispatchPlan:
    token: torch.Tensor  # [S] token index of each kept slot, grouped by expert
    gate: torch.Tensor  # [S] gate of each kept slot (differentiable)
    counts: torch.Tensor  # [N] kept slots per expert: the lengths of the contiguous groups
    routed: torch.Tensor  # [N] slots routed to each expert before dropping
    slot: torch.Tensor  # [S] slot id r·T + t (choice rank r, token t) of each kept slot

    @property
    def dropped(self) -> int:
        return int(self.routed.sum() - self.counts.sum())


def plan_dispatch(indices: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int | None = None,
                  seq_len: int | None = None) -> DispatchPlan:
    """Group the T·k token-slots by expert with one stable argsort, dropping each expert's overflow per sequence.

    `indices` [tokens, k] are sequences of `seq_len` consecutive tokens (default: one sequence). Slots are numbered
    r·tokens + t, and sorted stably by (expert, sequence): each expert's slots form one contiguous group, and inside
    it each sequence's slots stay in priority order (choice rank, then position), so "over capacity" is simply
    "position in the (expert, sequence) run >= capacity".

    Context parallelism (chunks of each sequence per rank) needs one exchange: all-gather every chunk's slot counts
    per (choice rank, expert); start each local run after the higher-priority slots held by the other cp ranks.
    """
    num_tokens, k = indices.shape
    seq_len = seq_len or num_tokens
    sequences = num_tokens // seq_len
    expert_of_slot = indices.t().reshape(-1)
    slots = torch.arange(expert_of_slot.numel(), device=indices.device)
    run = expert_of_slot * sequences + (slots % num_tokens) // seq_len  # (expert, sequence), expert major
    order = torch.argsort(run, stable=True)
    routed = torch.bincount(expert_of_slot, minlength=num_experts)
    counts = routed
    if capacity is not None:
        sizes = torch.bincount(run, minlength=num_experts * sequences)
        position = slots - (sizes.cumsum(0) - sizes)[run[order]]
        order = order[position < capacity]
        counts = sizes.clamp(max=capacity).view(num_experts, sequences).sum(dim=1)
    token = order % num_tokens
    gate = weights.t().reshape(-1)[order]
    return DispatchPlan(token, gate, counts, routed, order)


def grouped_mm_works(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm (private, torch >= 2.8) takes these operands: on CPU it needs fp32 and rows whose
    byte strides are multiples of 16 (checked on torch 2.13.0); on CUDA, bf16 on recent GPUs."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    if x.device.type == "cpu":
        aligned = all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], w.shape[-1]))
        return x.dtype == torch.float32 and aligned
    return x.dtype == torch.bfloat16


def swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert on rows x [n, d_model]: (silu(x w1) ⊙ x w3) w2."""
    return (F.silu(x @ w1) * (x @ w3)) @ w2


class Experts(nn.Module):
    """N SwiGLU experts stored as batched weights: w1, w3 [N, d_model, d_expert] and w2 [N, d_expert, d_model].

    backend: "loop" runs one matmul per expert on its contiguous slice; "grouped_mm" runs torch._grouped_mm with
    the group offsets; "auto" takes grouped_mm when `grouped_mm_works`, else the loop.
    """

    def __init__(self, n_experts: int, d_model: int, d_expert: int, backend: str = "auto") -> None:
        super().__init__()
        if backend not in ("auto", "loop", "grouped_mm"):
            raise ValueError(f"experts backend {backend!r} is unknown; choose 'auto', 'loop' or 'grouped_mm'")
        self.backend = backend
        # Zeros here; build_model / init_parameters give the values (N(0, σ), w2 scaled as a residual output).
        self.w1 = nn.Parameter(torch.zeros(n_experts, d_model, d_expert))
        self.w3 = nn.Parameter(torch.zeros(n_experts, d_model, d_expert))
        self.w2 = nn.Parameter(torch.zeros(n_experts, d_expert, d_model))

    def per_expert(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(w1, w3, w2) of each expert. unbind, not w[e] in a loop: the backward of N selects would allocate N
        zero gradients of the full [N, ...] shape; unbind's backward stacks the N pieces once."""
        return list(zip(self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [S, d_model] grouped by expert (counts[e] rows for expert e, in order) -> [S, d_model]."""
        use_grouped = self.backend == "grouped_mm" or (self.backend == "auto" and grouped_mm_works(x, self.w1))
        if use_grouped:
            offsets = counts.cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, self.w1, offs=offsets)) * torch._grouped_mm(x, self.w3, offs=offsets)
            return torch._grouped_mm(h, self.w2, offs=offsets)
        # split, not x[a:b] in a loop, for the same reason as unbind: its backward is one concatenation.
        outputs = [swiglu(xe, *w) for xe, w in zip(x.split(counts.tolist()), self.per_expert()) if xe.shape[0]]
        return torch.cat(outputs) if outputs else x.new_zeros(0, self.w2.shape[-1])


# ----------------------------------------------------------------------------------------------------------------
# the layer


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
        self.last_stats: dict | None = None
        self.seq_reduce: Callable | None = None  # context parallelism: sums over the ranks holding each sequence

    def route(self, x: torch.Tensor) -> Routing:
        """Routing of rows x [T, d_model] in (at least) fp32 (Switch §2.4, "selective precision")."""
        logits = F.linear(_at_least_fp32(x), _at_least_fp32(self.router.weight))
        return route(logits, self.top_k, self.router_kind, self.router_bias, self.renormalize, self.scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        seq_len = shape[-2]
        x = x.reshape(-1, shape[-1])
        routing = self.route(x)
        capacity = expert_capacity(seq_len, self.n_experts, self.top_k, self.capacity_factor)
        plan = plan_dispatch(routing.indices, routing.weights, self.n_experts, capacity, seq_len)
        h = self.experts(x.index_select(0, plan.token), plan.counts)
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
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert += routed.to(self.tokens_per_expert.dtype)
                dropped = routed.sum() - plan.counts.sum()
                sums = [*routed, dropped, per_sequence.sum(), per_sequence.numel(), z * tokens, tokens]
                self.step_sums += torch.stack([torch.as_tensor(v).to(self.step_sums) for v in sums])
        self.last_stats = {
            "expert_load": (routed.float() / slots).cpu(),
            "drop_rate": plan.dropped / slots,
            "balance_loss": float(balance.detach()),
            "z_loss": float(z.detach()),
        }


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


# ----------------------------------------------------------------------------------------------------------------
# what the trainer calls


def moe_layers(model: nn.Module) -> list[MoELayer]:
    return [m for m in model.modules() if isinstance(m, MoELayer)]


@torch.no_grad()
def take_step_sums(model: nn.Module, n_layers: int, n_experts: int) -> torch.Tensor:
    """[n_layers, N + 5] float64: each MoE layer's `step_sums` in the row of its block (zeros for dense blocks and
    blocks on other pipeline stages), then reset. Rows from different ranks add up."""
    device = next(model.parameters()).device  # collectives (NCCL) take tensors on the compute device
    sums = torch.zeros(n_layers, n_experts + len(STEP_FIELDS), dtype=torch.float64, device=device)
    for m in moe_layers(model):
        sums[m.layer_index] = m.step_sums.to(sums)
        m.step_sums.zero_()
    return sums


def balance_figures(sums: torch.Tensor) -> dict[str, float]:
    """The logged figures from `take_step_sums` rows (added over ranks), averaged over the layers that routed.

    moe_load_imbalance: max_i load_i / mean load (1 = perfectly balanced, N = top-1 collapse), also its maximum
    over layers; moe_drop_rate: fraction of token-slots dropped for capacity; moe_balance_loss (mean over
    sequences) and moe_z_loss (mean over tokens): the unweighted losses.
    """
    n_experts = sums.shape[1] - len(STEP_FIELDS)
    rows = sums[sums[:, n_experts + STEP_FIELDS.index("sequences")] > 0]
    if rows.numel() == 0:
        return {}
    routed, extra = rows[:, :n_experts], dict(zip(STEP_FIELDS, rows[:, n_experts:].unbind(1)))
    slots = routed.sum(dim=1)
    imbalance = routed.max(dim=1).values * n_experts / slots
    return {
        "moe_load_imbalance": imbalance.mean().item(),
        "moe_max_load_imbalance": imbalance.max().item(),
        "moe_drop_rate": (extra["dropped"] / slots).mean().item(),
        "moe_balance_loss": (extra["balance_sum"] / extra["sequences"]).mean().item(),
        "moe_z_loss": (extra["z_sum"] / extra["tokens"]).mean().item(),
    }


def moe_stats(model: nn.Module, reduce_fn: Callable[[torch.Tensor], object] | None = None) -> dict[str, float]:
    """`balance_figures` of the training forwards since the previous call ({} for a dense model). `reduce_fn` sums a
    tensor in place over the ranks holding other rows or stages (collective: each calls it, MoE layers or not)."""
    cfg = model.cfg
    if cfg.moe.n_experts == 0:
        return {}
    sums = take_step_sums(model, cfg.n_layers, cfg.moe.n_experts)
    if reduce_fn is not None:
        reduce_fn(sums)
    return balance_figures(sums)


@torch.no_grad()
def update_router_biases(model: nn.Module, reduce_fn: Callable[[torch.Tensor], object] | None = None) -> None:
    """Auxiliary-loss-free balancing (Wang et al. 2024; DeepSeek-V3 §2.1.2): b_i += γ·sign(mean_load − load_i).

    After each optimizer step. load_i: slots routed to expert i by the training forwards since the previous call
    (then reset); reduce_fn sums a tensor in place over the replicas (all layers in one). γ = 0: only a reset.
    """
    layers = moe_layers(model)
    active = [m for m in layers if m.bias_update_speed > 0]
    if active:
        loads = torch.cat([m.tokens_per_expert for m in active])
        if reduce_fn is not None:
            reduce_fn(loads)
        for m, load in zip(active, loads.split([m.n_experts for m in active])):
            if load.sum() > 0:
                m.router_bias += m.bias_update_speed * torch.sign(load.mean() - load)
    for m in layers:
        m.tokens_per_expert.zero_()
