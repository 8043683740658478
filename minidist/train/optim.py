"""The optimizer and its learning-rate schedule: AdamW with decoupled weight decay, warm-up then cosine decay.

Which parameters are decayed. Weight decay (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization")
pulls every decayed weight towards zero by lr·λ·w per step. We decay the matrices of linear layers (and MoE expert
weights, stored as 3-D tensors) and nothing else:

- norm gains and biases: a gain of 1 is the neutral value, not 0; decaying it fights the normalization, and these
  vectors hold too few numbers to overfit with;
- embeddings (token and learned position): a row moves only when its token occurs, but decay shrinks every row
  every step, so rare tokens drift to zero between their updates; OLMo 2 (OLMo et al. 2024, "2 OLMo 2 Furious",
  §3.2) dropped embedding decay for stability. With tied embeddings the shared matrix counts as an embedding.

The rule reads module types and shapes, not names, so a tensor-parallel swap of nn.Linear for a sharded linear
keeps working as long as the sharded weight stays 2-D and the embedding stays an nn.Embedding subclass.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices (decayed) and everything else (norm gains, biases, embeddings: not decayed)."""
    embedding_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    decay, no_decay = [], []
    for param in model.parameters():  # .parameters() yields a tied weight once
        if not param.requires_grad:
            continue
        if param.ndim >= 2 and id(param) not in embedding_ids:
            decay.append(param)
        else:
            no_decay.append(param)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float] = (0.9, 0.95),
                    eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW over `param_groups`. The fused kernel is used on CUDA only (on CPU it is not faster)."""
    on_cuda = next(model.parameters()).device.type == "cuda"
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps,
                             fused=True if on_cuda else False)


# Param-group keys that are this device's choice of kernel, not the update's math: a checkpoint does not carry them.
IMPLEMENTATION = frozenset({"params", "name", "foreach", "fused", "capturable", "differentiable"})


def group_settings(optimizer: torch.optim.Optimizer) -> dict[str, dict]:
    """{group name: its settings (lr, betas, eps, weight_decay, ...)} of every param group (`optimizer` may be a
    ZeRO engine or ExpertReplicas: their `param_groups` are their shards'). What a checkpoint keeps besides the
    state tensors; layout-free, since groups of one name hold the same settings on every rank and shard."""
    out: dict[str, dict] = {}
    for name, _, settings in _named_settings(optimizer):
        if out.setdefault(name, settings) != settings:
            raise ValueError(f"param groups named {name} differ: {out[name]} and {settings}")
    return out


def load_group_settings(optimizer: torch.optim.Optimizer, saved: object) -> list[str]:
    """Give every param group the settings `group_settings` saved for its name, as torch's `load_state_dict` does;
    return those that differ from this run's own, lr aside (the schedule sets it before every step). A group or
    setting missing, or of another type than this run's, is a one-line ValueError."""
    if not isinstance(saved, dict):
        raise ValueError(f"the param-group settings are a {type(saved).__name__}, not a dict by group name")
    changed = []
    for name, group, mine in _named_settings(optimizer):
        theirs = saved.get(name)
        if not isinstance(theirs, dict) or sorted(theirs) != sorted(mine):
            raise ValueError(f"the checkpoint's settings of param group {name} are not {sorted(mine)}")
        for key, value in theirs.items():
            if not _same_kind(value, mine[key]):
                raise ValueError(f"param group {name}: {key}={value!r} does not fit ({mine[key]!r} here)")
            if value != mine[key] and key != "lr" and f"{key} {value}" not in changed:
                changed.append(f"{key} {value}")
        group.update(theirs)
    return changed


def _named_settings(optimizer: torch.optim.Optimizer) -> Iterator[tuple[str, dict, dict]]:
    """(name, group, settings) of every param group: its name (its index if unnamed), the group, and its keys
    but IMPLEMENTATION's."""
    for i, group in enumerate(optimizer.param_groups):
        yield str(group.get("name", i)), group, {k: v for k, v in group.items() if k not in IMPLEMENTATION}


def _same_kind(value: object, like: object) -> bool:
    """The same type as `like` (tuples element by element), and a finite float where `like` is a float."""
    if isinstance(like, tuple):
        return isinstance(value, tuple) and len(value) == len(like) and all(map(_same_kind, value, like))
    return type(value) is type(like) and (not isinstance(value, float) or math.isfinite(value))


@dataclass
class WarmupCosine:
    """Linear warm-up from ~0 to max_lr over warmup_steps, then cosine decay to min_lr at total_steps.

    lr(s) = max_lr·(s+1)/warmup                                       for s < warmup
          = min_lr + ½(max_lr − min_lr)(1 + cos(π·(s − warmup)/(total − warmup)))   afterwards (min_lr past total)

    The schedule is a pure function of the step, so resuming needs only the step; `state_dict` stores the
    settings so a resumed run can check it continues the same schedule.
    """

    max_lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int

    def __post_init__(self) -> None:
        if self.max_lr < 0 or self.min_lr < 0:
            raise ValueError(f"learning rates must be >= 0, got lr={self.max_lr}, min_lr={self.min_lr}")
        if self.min_lr > self.max_lr:
            raise ValueError(f"min_lr={self.min_lr} is above lr={self.max_lr}; pick min_lr <= lr")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.max_lr * (step + 1) / self.warmup_steps
        decay_steps = self.total_steps - self.warmup_steps
        if decay_steps <= 0 or step >= self.total_steps:
            return self.min_lr if decay_steps > 0 else self.max_lr
        progress = (step - self.warmup_steps) / decay_steps
        return self.min_lr + 0.5 * (self.max_lr - self.min_lr) * (1.0 + math.cos(math.pi * progress))

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set the learning rate of every group for `step`; return it."""
        lr = self(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, state: dict) -> None:
        if state != self.state_dict():
            changed = [f"{k} {state.get(k)} -> {v}" for k, v in self.state_dict().items() if state.get(k) != v]
            raise ValueError(f"the checkpoint's LR schedule differs from this run's: {', '.join(changed)}")
