"""An optimizer step that the device may cancel: the guard against a non-finite update, decided without a host read.

The trainer must never write a NaN or inf update into the weights, yet reading "is the loss finite?" on the host every
step would stop a GPU's host until the step's kernels ran. So the step runs with a bool tensor `apply`; where it is
False the step leaves the parameters and the optimizer state exactly as they were, and the trainer reports the
divergence at its next read (`minidist.train.loop`). How, by optimizer:

- a fused torch optimizer (AdamW with fused=True, the trainer's choice on CUDA) takes a `found_inf` flag, as under
  `torch.amp.GradScaler`: the kernel skips the update and the step counters are put back, at no cost;
- any other optimizer (the trainer's choice on a CPU, where a host read costs nothing: the ops ran already) reads
  `apply` once; on a step to skip it is stepped anyway (ZeRO's collectives around it run on every rank alike), then
  every tensor it wrote (parameters and state) is put back from a copy taken before the step; state that did not
  exist yet goes back to zeros, which is what torch's AdamW holds after a fused step skipped by found_inf (the next
  step then starts as fresh). Exact, and the copies are paid only on a skipped step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


def _fused(optimizer: torch.optim.Optimizer) -> bool:
    return all(group.get("fused") for group in optimizer.param_groups)


def _stepped(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


@contextlib.contextmanager
def skip_unless(apply: torch.Tensor | None, optimizers: Sequence[torch.optim.Optimizer]) -> Iterator[None]:
    """Inside the block, every step of `optimizers` (the torch optimizers that hold state, however they are called:
    ZeRO steps them inside its own step) takes effect only where `apply` is True; None: always."""
    if apply is None:
        yield
        return
    handles, flagged = [], [o for o in optimizers if _fused(o)]
    unfused = [o for o in optimizers if not _fused(o)]
    if unfused and bool(apply):  # the one host read, only where no fused kernel takes the flag
        unfused = []
    for optimizer in flagged:
        optimizer.found_inf = (~apply).to(torch.float32)
    for optimizer in unfused:  # a step to skip: put back what it writes
        saved: dict[int, tuple[torch.Tensor, dict]] = {}
        handles.append(optimizer.register_step_pre_hook(lambda opt, args, kwargs, saved=saved: _save(opt, saved)))
        handles.append(optimizer.register_step_post_hook(
            lambda opt, args, kwargs, saved=saved: _restore(opt, saved, apply)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for optimizer in flagged:
            del optimizer.found_inf


@torch.no_grad()
def _save(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    for p in _stepped(optimizer):
        state = optimizer.state.get(p, {})
        saved[id(p)] = (p.detach().clone(), {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)})


@torch.no_grad()
def _restore(optimizer: torch.optim.Optimizer, saved: dict, apply: torch.Tensor) -> None:
    for p in _stepped(optimizer):
        if id(p) not in saved:
            continue
        before, state_before = saved.pop(id(p))
        p.copy_(torch.where(apply, p, before))
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                old = state_before.get(key)
                value.copy_(torch.where(apply, value, old if old is not None else torch.zeros_like(value)))
