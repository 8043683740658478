"""ZeRO in bytes: the paper's formulas for memory per rank and communication per step (Rajbhandari et al. 2020, §5
and §7). The counters that measure what a rank really holds are `minidist.memory`'s (`storage_bytes`, `PeakBytes`).

                         model states per rank               sent per rank per step (1 micro-batch)
    stage 0 (baseline)   (P + G + K)·Ψ                       all-reduce                      2(N-1)/N·M
    stage 1 (P_os)       P·Ψ + G·Ψ + K·Ψ/N_d                 reduce-scatter + all-gather     2(N-1)/N·M
    stage 2 (P_os+g)     P·Ψ + (G + K)·Ψ/N_d                 reduce-scatter + all-gather     2(N-1)/N·M
    stage 3 (P_os+g+p)   (P + G + K)·Ψ/N_d                   2 all-gathers + reduce-scatter  3(N-1)/N·M

for Ψ parameters of P bytes, gradients of G bytes and K bytes of optimizer state per parameter, N = N_d ranks and
M = Ψ·element size (with several micro-batches, `zero_comm_bytes` says which collectives repeat).
"""

from __future__ import annotations

from minidist.memory import check_zero_stage, model_state_bytes


def zero_memory_bytes(n_params: int, dp: int, stage: int, optimizer_bytes_per_param: float = 12,
                      param_bytes: float = 2, grad_bytes: float = 2) -> float:
    """Model-state bytes per rank at ZeRO `stage` (Rajbhandari et al. 2020, §5, Figure 1).

    Defaults are the paper's mixed precision: (2 + 2 + K)·Ψ for the baseline with K = 12. For fp32 training with
    Adam pass param_bytes=4, grad_bytes=4, optimizer_bytes_per_param=8. This is `memory.model_state_bytes` with K
    the optimizer state, master copy included.
    """
    return model_state_bytes(n_params, param_bytes, grad_bytes, master_bytes=0,
                             optimizer_bytes=optimizer_bytes_per_param, zero=stage, dp=dp)["total"]


def zero_comm_bytes(n_params: int, dp: int, stage: int, microbatches: int = 1,
                    element_size: int = 4, gather_element_size: int | None = None) -> dict[str, float]:
    """Bytes each rank sends per optimizer step, by collective, for `n_params` elements (ring algorithms).
    `element_size`: the gradients' reduce dtype (and the parameters' at stages 1-2); `gather_element_size`: stage
    3's parameter gathers (`precision.CommPrecision.gather_dtype`; default element_size).

    all-reduce sends 2(N-1)/N·M, reduce-scatter and all-gather (N-1)/N·M each, M = Ψ·element_size:
        stage 0   all-reduce once (gradient accumulation communicates on the last micro-batch only)
        stage 1   reduce-scatter once + all-gather of the updated parameters once
        stage 2   reduce-scatter every micro-batch + all-gather once
        stage 3   per micro-batch: all-gather for forward, all-gather for backward, reduce-scatter
    """
    check_zero_stage(stage)
    one = (dp - 1) / dp * n_params * element_size
    gathered = one if gather_element_size is None else one * gather_element_size / element_size
    m = microbatches
    return {0: {"all_reduce": 2 * one},
            1: {"reduce_scatter": one, "all_gather": one},
            2: {"reduce_scatter": m * one, "all_gather": one},
            3: {"reduce_scatter": m * one, "all_gather": 2 * m * gathered}}[stage]
