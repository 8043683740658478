"""MoE capacity and sorted dispatch, and the experts that run the dispatched tokens (chapter 06)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn


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


def count_values(values: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in `values` (all in that range): `torch.bincount(values, minlength=n)`, which
    on CUDA reads the largest value on the host to size its output; a scatter of ones needs no read."""
    return torch.zeros(n, dtype=torch.int64, device=values.device).scatter_add_(0, values, torch.ones_like(values))


@dataclass
class DispatchPlan:
    token: torch.Tensor  # [S] token index of each kept slot, grouped by expert
    gate: torch.Tensor  # [S] gate of each kept slot (differentiable)
    counts: torch.Tensor  # [N] kept slots per expert: the lengths of the contiguous groups
    routed: torch.Tensor  # [N] slots routed to each expert before dropping
    slot: torch.Tensor  # [S] slot id r·T + t (choice rank r, token t) of each kept slot
    padded: bool = False  # S = T·k: the kept slots first, then the dropped ones (gate 0); see `plan_dispatch`

    @property
    def dropped(self) -> int:
        return int(self.routed.sum() - self.counts.sum())


def plan_dispatch(indices: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int | None = None,
                  seq_len: int | None = None, padded: bool = False) -> DispatchPlan:
    """Group the T·k token-slots by expert with one stable argsort, dropping each expert's overflow per sequence.

    `indices` [tokens, k] are sequences of `seq_len` consecutive tokens (default: one sequence). Slots are numbered
    r·tokens + t, and sorted stably by (expert, sequence): each expert's slots form one contiguous group, and inside
    it each sequence's slots stay in priority order (choice rank, then position), so "over capacity" is simply
    "position in the (expert, sequence) run >= capacity".

    Context parallelism (chunks of each sequence per rank) needs one exchange: all-gather every chunk's slot counts
    per (choice rank, expert); start each local run after the higher-priority slots held by the other cp ranks.

    `padded` (the layer's path): keep every slot, the dropped ones after the kept with gate 0. How many slots a
    capacity keeps is data: selecting them (`order[kept]`) sizes a tensor from a count the host must read, a
    stream sync on a GPU. The experts then run only the first counts.sum() rows (`Experts.forward(padded=True)`).
    """
    num_tokens, k = indices.shape
    seq_len = seq_len or num_tokens
    sequences = num_tokens // seq_len
    expert_of_slot = indices.t().reshape(-1)
    slots = torch.arange(expert_of_slot.numel(), device=indices.device)
    run = expert_of_slot * sequences + (slots % num_tokens) // seq_len  # (expert, sequence), expert major
    order = torch.argsort(run, stable=True)
    routed = count_values(expert_of_slot, num_experts)
    counts = routed
    if capacity is not None:
        sizes = count_values(run, num_experts * sequences)
        position = slots - (sizes.cumsum(0) - sizes)[run[order]]
        dropped = position >= capacity
        if padded:  # the kept first, in their order (a stable sort of the dropped flag): no data-sized tensor
            order = order[torch.argsort(dropped.to(torch.int8), stable=True)]
            dropped = dropped.sum() > torch.arange(order.numel() - 1, -1, -1, device=order.device)
        else:
            order = order[~dropped]
        counts = sizes.clamp(max=capacity).view(num_experts, sequences).sum(dim=1)
    token = order % num_tokens
    gate = weights.t().reshape(-1)[order]
    if capacity is not None and padded:
        gate = torch.where(dropped, torch.zeros_like(gate), gate)
    return DispatchPlan(token, gate, counts, routed, order, padded)


EXPERT_BACKENDS = ("auto", "loop", "grouped_mm")


def grouped_mm_dtype(x_dtype: torch.dtype, w_dtype: torch.dtype, device_type: str,
                     autocast_dtype: torch.dtype | None = None, aligned: bool = True) -> torch.dtype | None:
    """The dtype torch._grouped_mm (private, torch >= 2.8) runs the experts in here, or None (the loop).

    CUDA's contract on every device (`device_type` is kept for callers): bf16 operands whose rows' byte strides
    are multiples of 16 (`aligned`). Under bf16 autocast (`autocast_dtype`) the operands are cast to it as autocast
    casts every other matmul's: the fp32 residual stream alone would keep the experts on the loop of one matmul
    per expert. The CPU kernel also takes fp32 (checked on torch 2.13.0), but the op's meta function, which
    torch.compile traces with on any device, is CUDA's rule ("Expected inputs of BF16 type"): a compiled fp32 CPU
    run would fail at its first trace. `Experts(backend="grouped_mm")` still runs it on fp32 eagerly."""
    if not hasattr(torch, "_grouped_mm"):
        return None
    dtype = autocast_dtype if autocast_dtype is not None else (x_dtype if x_dtype == w_dtype else None)
    return dtype if dtype == torch.bfloat16 and aligned else None


def grouped_mm_choice(x_dtype: torch.dtype, w_dtype: torch.dtype, device_type: str,
                      autocast_dtype: torch.dtype | None, widths: tuple[int, ...]) -> torch.dtype | None:
    """`grouped_mm_dtype` with the rows' alignment judged in the dtype the GEMMs run in (bf16 rows of an fp32
    model under autocast are half as many bytes): `widths` are the operands' row lengths (d_model, d_expert)."""
    dtype = grouped_mm_dtype(x_dtype, w_dtype, device_type, autocast_dtype)
    aligned = dtype is not None and all(n * dtype.itemsize % 16 == 0 for n in widths)
    return dtype if aligned else None


def grouped_mm_operand_dtype(x: torch.Tensor, w: torch.Tensor) -> torch.dtype | None:
    """`grouped_mm_choice` of these operands under the autocast state of their device (None: the loop)."""
    device = x.device.type
    autocast = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    return grouped_mm_choice(x.dtype, w.dtype, device, autocast, (x.shape[-1], w.shape[-1]))


def grouped_mm_works(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the "auto" backend runs these operands through torch._grouped_mm (else the loop)."""
    return grouped_mm_operand_dtype(x, w) is not None


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
        if backend not in EXPERT_BACKENDS:
            raise ValueError(f"experts backend {backend!r} is unknown; choose one of {EXPERT_BACKENDS}")
        self.backend = backend
        # Zeros here; build_model / init_parameters give the values (N(0, σ), w2 scaled as a residual output).
        self.w1 = nn.Parameter(torch.zeros(n_experts, d_model, d_expert))
        self.w3 = nn.Parameter(torch.zeros(n_experts, d_model, d_expert))
        self.w2 = nn.Parameter(torch.zeros(n_experts, d_expert, d_model))

    def per_expert(self) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(w1, w3, w2) of each expert. unbind, not w[e] in a loop: the backward of N selects would allocate N
        zero gradients of the full [N, ...] shape; unbind's backward stacks the N pieces once."""
        return list(zip(self.w1.unbind(0), self.w3.unbind(0), self.w2.unbind(0)))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, padded: bool = False) -> torch.Tensor:
        """x [S, d_model] grouped by expert (counts[e] rows for expert e, in order) -> [S, d_model] in x's dtype (the
        layer sums the k outputs of a token into the residual stream's dtype). `padded`: x may have rows after the
        counts.sum() grouped ones (the dropped slots of `plan_dispatch(padded=True)`); their outputs are zeros."""
        dtype = grouped_mm_operand_dtype(x, self.w1) if self.backend != "loop" else None
        if dtype is not None or self.backend == "grouped_mm":
            dtype = dtype or x.dtype
            offsets = counts.cumsum(0).to(torch.int32)
            # _grouped_mm leaves the rows past the last offset unwritten (memory as found, NaN included): a
            # where, not a product, makes them zeros, and the same where zeroes their gradient on the way back.
            grouped = (torch.arange(x.shape[0], device=x.device) < offsets[-1]).unsqueeze(-1) if padded else None
            x = torch.where(grouped, x, 0) if padded else x
            xg, w1, w3, w2 = (t.to(dtype) for t in (x, self.w1, self.w3, self.w2))
            h = F.silu(torch._grouped_mm(xg, w1, offs=offsets)) * torch._grouped_mm(xg, w3, offs=offsets)
            y = torch._grouped_mm(h, w2, offs=offsets).to(x.dtype)
            return torch.where(grouped, y, 0) if padded else y
        return self._loop(x, counts, padded)

    @torch.compiler.disable  # in a compiled block, run eagerly: each expert's rows are data (a host read)
    def _loop(self, x: torch.Tensor, counts: torch.Tensor, padded: bool = False) -> torch.Tensor:
        """One matmul per expert on its slice. Never traced: the slice sizes come from `counts.tolist()`, and a
        compiled loop specialized on them was a recompile at almost every forward (57 in 10 steps of ep2)."""
        sizes = counts.tolist()  # the loop sizes each matmul on the host: a read (the grouped_mm path has none)
        rest = x.shape[0] - sum(sizes) if padded else 0
        # split, not x[a:b] in a loop, for the same reason as unbind: its backward is one concatenation.
        pieces = x.split(sizes + [rest] if rest else sizes)
        outputs = [swiglu(xe, *w) for xe, w in zip(pieces, self.per_expert()) if xe.shape[0]]
        outputs += [x.new_zeros(rest, self.w2.shape[-1])] if rest else []
        return torch.cat(outputs).to(x.dtype) if outputs else x.new_zeros(0, self.w2.shape[-1])
