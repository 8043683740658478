"""ZeRO in bytes: the paper's formulas for memory per rank and communication per step, and the counters that
measure what a rank really holds (Rajbhandari et al. 2020, §5 and §7).

                         model states per rank               sent per rank per step (1 micro-batch)
    stage 0 (baseline)   (P + G + K)·Ψ                       all-reduce                      2(N-1)/N·M
    stage 1 (P_os)       P·Ψ + G·Ψ + K·Ψ/N_d                 reduce-scatter + all-gather     2(N-1)/N·M
    stage 2 (P_os+g)     P·Ψ + (G + K)·Ψ/N_d                 reduce-scatter + all-gather     2(N-1)/N·M
    stage 3 (P_os+g+p)   (P + G + K)·Ψ/N_d                   2 all-gathers + reduce-scatter  3(N-1)/N·M

for Ψ parameters of P bytes, gradients of G bytes and K bytes of optimizer state per parameter, N = N_d ranks and
M = Ψ·element size (with several micro-batches, `zero_comm_bytes` says which collectives repeat).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def _check_stage(stage: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")


def zero_memory_bytes(n_params: int, dp: int, stage: int, optimizer_bytes_per_param: float = 12,
                      param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Model-state bytes per rank at ZeRO `stage` (Rajbhandari et al. 2020, §5, Figure 1).

    Defaults are the paper's mixed precision: (2 + 2 + K)·Ψ for the baseline with K = 12. For fp32 training with
    Adam pass param_bytes=4, grad_bytes=4, optimizer_bytes_per_param=8.
    """
    _check_stage(stage)
    if dp < 1 or n_params < 0:
        raise ValueError(f"need dp >= 1 and n_params >= 0, got dp={dp}, n_params={n_params}")
    psi, p, g, k = n_params, param_bytes, grad_bytes, optimizer_bytes_per_param
    sharded = {0: 0.0, 1: k, 2: g + k, 3: p + g + k}[stage]
    return (p + g + k - sharded) * psi + sharded * psi / dp


def zero_comm_bytes(n_params: int, dp: int, stage: int, microbatches: int = 1,
                    element_size: int = 4) -> dict[str, float]:
    """Bytes each rank sends per optimizer step, by collective, for `n_params` elements (ring algorithms).

    all-reduce sends 2(N-1)/N·M, reduce-scatter and all-gather (N-1)/N·M each, M = Ψ·element_size:
        stage 0   all-reduce once (gradient accumulation communicates on the last micro-batch only)
        stage 1   reduce-scatter once + all-gather of the updated parameters once
        stage 2   reduce-scatter every micro-batch + all-gather once
        stage 3   per micro-batch: all-gather for forward, all-gather for backward, reduce-scatter
    """
    _check_stage(stage)
    one = (dp - 1) / dp * n_params * element_size
    m = microbatches
    return {0: {"all_reduce": 2 * one},
            1: {"reduce_scatter": one, "all_gather": one},
            2: {"reduce_scatter": m * one, "all_gather": one},
            3: {"reduce_scatter": m * one, "all_gather": 2 * m * one}}[stage]


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors`: a view into a flat buffer is not counted twice."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        if storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


class PeakBytes:
    """Bytes of short-lived buffers (gathered units, in-flight gradient buckets): now and at the peak."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)

    def sub(self, nbytes: int) -> None:
        self.now -= nbytes
