"""What the trainer calls after a step (chapter 06): the logged balance figures of an MoE model, from sums that add
up over micro-batches, replicas and stages, and the auxiliary-loss-free router-bias update from the same counts."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minidist.model.moe.layer import STEP_FIELDS, MoELayer


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
