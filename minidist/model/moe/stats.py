"""What the trainer calls after a step (chapter 06): the logged balance figures of an MoE model, from sums that add
up over micro-batches, replicas and stages, and the auxiliary-loss-free router-bias update from the same counts."""

from __future__ import annotations

import math
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


def balance_figures_on_device(sums: torch.Tensor) -> dict[str, torch.Tensor]:
    """The logged figures from `take_step_sums` rows (added over ranks), averaged over the layers that routed: 0-d
    tensors on the sums' device, computed there (no host read; NaN when no layer routed).

    moe_load_imbalance: max_i load_i / mean load (1 = perfectly balanced, N = top-1 collapse), also its maximum
    over layers; moe_drop_rate: fraction of token-slots dropped for capacity; moe_balance_loss (mean over
    sequences) and moe_z_loss (mean over tokens): the unweighted losses.
    """
    n_experts = sums.shape[1] - len(STEP_FIELDS)
    routed, extra = sums[:, :n_experts], dict(zip(STEP_FIELDS, sums[:, n_experts:].unbind(1)))
    used = extra["sequences"] > 0  # the layers that routed (dense blocks and idle layers: rows of zeros)
    layers = used.sum()

    def per_layer(values: torch.Tensor) -> torch.Tensor:  # the layers that routed only, without a masked select
        return torch.where(used, values, torch.zeros_like(values))

    slots = routed.sum(dim=1)
    imbalance = per_layer(routed.max(dim=1).values * n_experts / slots)
    return {
        "moe_load_imbalance": imbalance.sum() / layers,
        "moe_max_load_imbalance": torch.where(used, imbalance, torch.full_like(imbalance, -torch.inf)).max()
        .where(layers > 0, torch.nan),
        "moe_drop_rate": per_layer(extra["dropped"] / slots).sum() / layers,
        "moe_balance_loss": per_layer(extra["balance_sum"] / extra["sequences"]).sum() / layers,
        "moe_z_loss": per_layer(extra["z_sum"] / extra["tokens"]).sum() / layers,
    }


def read_figures(figures: dict[str, torch.Tensor]) -> dict[str, float]:
    """Figures of `balance_figures_on_device` as floats, in one host read; {} when no layer routed."""
    if not figures:
        return {}
    values = torch.stack(list(figures.values())).tolist()
    return {} if math.isnan(values[0]) else dict(zip(figures, values))


def balance_figures(sums: torch.Tensor) -> dict[str, float]:
    """`balance_figures_on_device`, read: floats, {} when no layer routed."""
    return read_figures(balance_figures_on_device(sums))


def moe_stats_on_device(model: nn.Module, reduce_fn: Callable[[torch.Tensor], object] | None = None
                        ) -> dict[str, torch.Tensor]:
    """`balance_figures_on_device` of the training forwards since the previous call ({} for a dense model).
    `reduce_fn` sums a tensor in place over the ranks holding other rows or stages (collective: each calls it, MoE
    layers or not)."""
    cfg = model.cfg
    if cfg.moe.n_experts == 0:
        return {}
    sums = take_step_sums(model, cfg.n_layers, cfg.moe.n_experts)
    if reduce_fn is not None:
        reduce_fn(sums)
    return balance_figures_on_device(sums)


def moe_stats(model: nn.Module, reduce_fn: Callable[[torch.Tensor], object] | None = None) -> dict[str, float]:
    """`moe_stats_on_device`, read: floats ({} for a dense model, or when nothing was routed since the last call)."""
    return read_figures(moe_stats_on_device(model, reduce_fn))


@torch.no_grad()
def update_router_biases(model: nn.Module, reduce_fn: Callable[[torch.Tensor], object] | None = None,
                         apply: torch.Tensor | None = None) -> None:
    """Auxiliary-loss-free balancing (Wang et al. 2024; DeepSeek-V3 §2.1.2): b_i += γ·sign(mean_load − load_i).

    After each optimizer step. load_i: slots routed to expert i by the training forwards since the previous call
    (then reset); reduce_fn sums a tensor in place over the replicas (all layers in one). γ = 0: only a reset.
    `apply` (a bool tensor): False leaves the biases as they are (a step the trainer skipped on the device).
    """
    layers = moe_layers(model)
    active = [m for m in layers if m.bias_update_speed > 0]
    if active:
        loads = torch.cat([m.tokens_per_expert for m in active])
        if reduce_fn is not None:
            reduce_fn(loads)
        for m, load in zip(active, loads.split([m.n_experts for m in active])):
            step = m.bias_update_speed * torch.sign(load.mean() - load)  # no load at all: sign(0) = 0, no change
            m.router_bias += step if apply is None else torch.where(apply, step, torch.zeros_like(step))
    for m in layers:
        m.tokens_per_expert.zero_()
