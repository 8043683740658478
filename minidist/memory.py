"""Memory in bytes: what training holds, by part, from the shapes alone (chapter 01), and the counters that measure
what torch really holds.

Formulas:

* Model states (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
  §3.1 and §5): mixed-precision Adam holds 16-bit parameters and gradients (2 + 2 bytes per parameter) and, in fp32,
  a master copy of the parameters and the two Adam moments (4 + 4 + 4 = 12 bytes): 16 bytes per parameter. Plain
  fp32 training holds 4 + 4 + 8 = 16 bytes too, without the master copy. ZeRO shards the optimizer state over the
  data-parallel replicas from stage 1, the gradients from stage 2, the parameters at stage 3 (`model_state_bytes`).
* Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4):
  a GPT layer in 16-bit saves s·b·h·(34 + 5·a·s/h) bytes for the backward; the 5·a·s²·b part (softmax output,
  its dropout mask and the dropout output) is what a fused attention kernel (FlashAttention, SDPA) does not keep.
  `activation_bytes_per_layer` counts the same thing for this course's Llama block, tensor by tensor.

Counters, all on one core (`StorageBytes`: distinct storages, each counted once however many tensors view it, from
when it is first seen until torch frees it; `PeakBytes`: bytes now and at their peak):

* `storage_bytes`: the bytes of the distinct storages behind some tensors (a view into a flat buffer counts once).
* `LiveTensorBytes`: tensor accounting on any device: every tensor an operator creates is counted until its
  storage is freed, so `peak` and `current` are exact byte counts of what torch allocated inside the context.
* `PeakSavedBytes`: the bytes autograd saves for the backward: `total` every storage saved (against the formulas
  above), `current` and `peak` those alive at once (a saved storage counts until the backward that used it frees
  it). With several micro-batches in flight (a pipeline) the peak is the activation memory the memory model
  (`plan.rank_memory`) predicts.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from minidist.model.config import ModelConfig

# ------------------------------------------------------------------------------------------------------------------
# formulas, from the shapes


def check_zero_stage(stage: int) -> None:
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")


def model_state_bytes(n_params: int, param_bytes: float = 2, grad_bytes: float = 2, master_bytes: float = 4,
                      optimizer_bytes: float = 8, zero: int = 0, dp: int = 1) -> dict[str, float]:
    """Bytes of parameters, gradients, fp32 master copy and optimizer state (AdamW: two moments) that one rank
    holds for n_params, at ZeRO stage `zero` over `dp` data-parallel replicas (ZeRO §5, Figure 1).

    Defaults: bf16 mixed precision, 2 + 2 + 4 + 8 = 16 bytes per parameter (ZeRO §3.1). Plain fp32 AdamW:
    param_bytes=4, grad_bytes=4, master_bytes=0 (the parameters are the master copy). ZeRO shards the master copy
    and the optimizer state from stage 1, the gradients from stage 2, the parameters at stage 3. Leaves out the
    optimizer's per-tensor step counters and the allocator's rounding.
    """
    check_zero_stage(zero)
    if dp < 1 or n_params < 0:
        raise ValueError(f"need dp >= 1 and n_params >= 0, got dp={dp}, n_params={n_params}")

    def held(nbytes: float, from_stage: int) -> float:
        return nbytes * n_params / dp if zero >= from_stage else nbytes * n_params

    parts = {"params": held(param_bytes, 3), "grads": held(grad_bytes, 2), "master": held(master_bytes, 1),
             "optimizer": held(optimizer_bytes, 1)}
    parts["total"] = sum(parts.values())
    return parts


def korthikanti_activation_bytes(seq_len: int, batch: int, d_model: int, n_heads: int, flash: bool = False) -> int:
    """Korthikanti et al. 2022 §4, one GPT layer in 16-bit, no parallelism: s·b·h·(34 + 5·a·s/h) bytes.

    flash=True drops the 5·a·s²·b term (a fused kernel recomputes the scores in the backward instead of keeping
    the s × s softmax, its dropout mask and output); the per-row softmax statistics it keeps are O(s), left out.
    """
    s, b, h, a = seq_len, batch, d_model, n_heads
    return s * b * h * 34 + (0 if flash else 5 * a * s * s * b)


def activation_bytes_per_layer(cfg: ModelConfig, seq_len: int, batch: int, dtype_bytes: int = 2) -> dict[str, int]:
    """Bytes one `minidist.model.Block` (RMSNorm, GQA with RoPE and fused SDPA, SwiGLU; no dropout) saves for
    the backward, by part, with activations of dtype_bytes (2: bf16, 4: fp32).

    Derived from what autograd saves for each operator of the block:
    * each RMSNorm: its input upcast to fp32 (4·bsh), 1/rms (4·bs, fp32), the normalized tensor before the gain
      and the output (the linear layers' input), dtype_bytes·bsh each;
    * attention: q (bsh), k and v (b·s·kv_heads·head_dim each), SDPA's output and its contiguous copy (the output
      projection's input), plus the fused kernel's fp32 log-sum-exp (4·b·heads·s) — no s × s tensor;
    * SwiGLU: the two up-projections, the SiLU output and the product (the down-projection's input), bsf each.
    Not in it: RoPE's cos/sin (shared by all layers), the embedding, final norm, logits and loss.
    """
    s, b, h, p = seq_len, batch, cfg.d_model, dtype_bytes
    kv = cfg.n_kv_heads * cfg.head_dim
    norms = 2 * (4 * b * s * h + 4 * b * s + 2 * p * b * s * h)
    attention = p * (3 * b * s * h + 2 * b * s * kv) + 4 * b * cfg.n_heads * s
    mlp = 4 * p * b * s * cfg.d_ff
    return {"norms": norms, "attention": attention, "mlp": mlp, "total": norms + attention + mlp}


# ------------------------------------------------------------------------------------------------------------------
# counters, measured


class PeakBytes:
    """Bytes now (`current`) and the most at once (`peak`): `add` when memory is taken, `sub` when it is given back
    (ZeRO's gathered units and in-flight gradient buckets count themselves this way)."""

    def __init__(self) -> None:
        self.current = self.peak = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def sub(self, nbytes: int) -> None:
        self.current -= nbytes


class StorageBytes(PeakBytes):
    """The counting core: distinct storages, each counted once however many tensors view it. `count(t)` adds the
    storage behind `t` if it is new; with `until_freed` it leaves `current` when torch frees it (else the caller
    holds every tensor counted, and `current` is their bytes). `storages`: the counted storages still alive, by
    key, with their bytes; `total`: every byte ever counted. Meta and empty storages hold no bytes and are skipped."""

    def __init__(self, until_freed: bool = True) -> None:
        super().__init__()
        self.until_freed = until_freed
        self.storages: dict[int, int] = {}
        self.total = 0

    def count(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key, size = storage._cdata, storage.nbytes()
        if key in self.storages or not size or storage.device.type == "meta":
            return
        self.storages[key] = size
        self.total += size
        self.add(size)
        if self.until_freed:
            weakref.finalize(storage, self._freed, key, size)

    def _freed(self, key: int, size: int) -> None:
        if self.storages.pop(key, None) is not None:
            self.sub(size)


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors`: a view into a flat buffer is not counted twice."""
    counter = StorageBytes(until_freed=False)
    for t in tensors:
        if t is not None:
            counter.count(t)
    return counter.total


class _CountedBytes:
    """`current`, `peak`, `total` and `storages` of a context's `StorageBytes` (`self.counted`)."""

    counted: StorageBytes

    @property
    def current(self) -> int:
        return self.counted.current

    @property
    def peak(self) -> int:
        return self.counted.peak

    @property
    def total(self) -> int:
        return self.counted.total

    @property
    def storages(self) -> dict[int, int]:
        """The counted storages still alive, by key, with their bytes."""
        return self.counted.storages


class LiveTensorBytes(TorchDispatchMode, _CountedBytes):
    """Counts the bytes of every tensor storage created inside the context while it is alive: `current` now,
    `peak` the most at once. Storages that existed before (the parameters) are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.counted = StorageBytes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # A view or an in-place result shares an input's storage (a weight's transpose inside F.linear): no bytes.
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_sparse and t.untyped_storage()._cdata not in inputs:
                self.counted.count(t)
        return out


class PeakSavedBytes(torch.autograd.graph.saved_tensors_hooks, _CountedBytes):
    """The bytes of the distinct storages autograd saves for the backward inside the context: `total` all of them,
    `current` and `peak` those alive at once.

    A storage counts from the first time autograd saves it until it is freed (the backward that used it dropped it
    and nothing else holds it). The storages of `params` (read at every save: a ZeRO-3 unit gathered just in time
    is a parameter too; autograd saves a weight as a plain alias of the parameter, so the check is by storage)
    and of `exclude` (buffers shared by every layer) are not activations and are skipped."""

    def __init__(self, params: Iterable[torch.Tensor] = (), exclude: Iterable[torch.Tensor] = ()) -> None:
        self._params = list(params)
        self._skip = {t.untyped_storage().data_ptr() for t in exclude}
        self.counted = StorageBytes()
        super().__init__(self._pack, lambda t: t)

    def __enter__(self) -> PeakSavedBytes:
        super().__enter__()
        return self

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata in self.counted.storages:  # counted already: skip the parameter check
            return t
        ptr = storage.data_ptr()
        if ptr not in self._skip and all(p.untyped_storage().data_ptr() != ptr for p in self._params):
            self.counted.count(t)
        return t
