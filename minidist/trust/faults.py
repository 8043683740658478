"""Fault drills: break a run on purpose, to see that the checks catch it.

`--inject-fault bitflip:STEP:RANK[:NAME]` flips one mantissa bit of one element of one parameter on global rank
RANK, after the optimizer step of step STEP (0-based, as `step` in metrics.jsonl): what a cosmic ray or a faulty
multiplier does to one GPU's copy of the weights. NAME defaults to the first parameter, in name order, of which some
other rank holds a copy (so that comparing copies can find it).

Detection must not know about the injection: nothing here tells the checks where the flip happened; they find it
by comparing replicas (`minidist.trust.replicas`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from minidist.trust.replicas import replicated_names

FLIPPED_BIT = 16  # of fp32's 23 mantissa bits: the element changes by about 1%, far below what the loss shows


class FaultError(ValueError):
    """A fault spec that cannot be applied (the trainer reports it as a bad setting, in one line)."""


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int
    name: str | None = None


def parse_fault(text: str) -> Fault:
    """'bitflip:STEP:RANK[:NAME]' -> Fault; a one-line FaultError for anything else."""
    parts = text.split(":")
    usage = f"--inject-fault {text!r} is not bitflip:STEP:RANK[:NAME] (e.g. bitflip:3:1)"
    if parts[0] != "bitflip" or len(parts) not in (3, 4) or not all(p.isascii() and p.isdecimal() for p in parts[1:3]):
        raise FaultError(usage)
    name = parts[3] if len(parts) == 4 else None
    if name == "":
        raise FaultError(usage)
    return Fault(parts[0], int(parts[1]), int(parts[2]), name)


def check_fault(text: str | None, steps: int, world_size: int) -> None:
    """The checks every rank can make before anything is built: a step the run takes, a rank that exists."""
    if text is None:
        return
    fault = parse_fault(text)
    if fault.step >= steps:
        raise FaultError(f"--inject-fault {text!r}: step {fault.step} is not among the run's steps 0..{steps - 1}")
    if fault.rank >= world_size:
        raise FaultError(f"--inject-fault {text!r}: rank {fault.rank} does not exist (world size {world_size})")


@torch.no_grad()
def flip_bit(param: torch.Tensor, index: int = 0, bit: int = FLIPPED_BIT) -> None:
    """Flip `bit` of element `index` of an fp32 tensor, in place, in its own storage."""
    if param.dtype != torch.float32 or param.numel() == 0:
        raise FaultError(f"a bit flip needs a non-empty fp32 tensor, got {param.dtype} of {param.numel()} elements")
    param.view(-1)[index : index + 1].view(torch.int32).bitwise_xor_(1 << bit)


def inject(text: str | None, step: int, rank: int, model: nn.Module, params_sharded: bool = False) -> str | None:
    """Apply the fault `text` if it is due at `step` on `rank`; return the flipped parameter's name (None if
    nothing was done)."""
    if text is None:
        return None
    fault = parse_fault(text)
    if fault.step != step or fault.rank != rank:
        return None
    name = fault_target(text, rank, model, params_sharded)
    flip_bit(dict(model.named_parameters())[name])
    return name


def fault_target(text: str, rank: int, model: nn.Module, params_sharded: bool = False) -> str:
    """The name of the parameter the fault `text` flips on `rank` (whose part of the model is `model`); a one-line
    FaultError if there is none. The trainer asks before step 0, so a bad name leaves no run behind."""
    fault = parse_fault(text)
    params = dict(model.named_parameters())
    candidates = replicated_names(model, params_sharded)
    name = fault.name or (candidates[0] if candidates else None)
    if name is None:
        raise FaultError(f"--inject-fault {text!r}: no parameter on rank {rank} has a replica (ZeRO-3 shards them "
                         "all, one process has none); name one: bitflip:STEP:RANK:NAME")
    if name not in params:
        raise FaultError(f"--inject-fault {text!r}: rank {rank} has no parameter {name!r}; it has "
                         f"{sorted(params)[:4]}...")
    return name
