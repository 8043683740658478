"""The gradient engines behind one interface: what `ParallelModel` asks of whatever reduces a step's gradients over
the replicas of this rank's parameters.

    SingleReplica    one replica (dp·cp = 1): nothing to reduce; the caller's optimizer updates whole parameters
    DataParallel     whole gradients averaged over dp_cp (buckets, overlap; chapter 07); the caller's optimizer
    ZeroOptimizer    gradients reduce-scattered over dp_cp, its own optimizer over this rank's shard (chapter 07)
    ExpertReplicas   with expert parallelism, one of the two above per replica group: dense parameters over dp_cp,
                     expert weights over edp (chapter 11)

A step talks to the engine in the same calls whatever it is: the backward passes start the reduction (gradient
hooks), `no_sync()` holds it back for the micro-batches before the last, `finish_grad_sync()` waits for it,
`grad_pieces()` and `norm_groups()` give the global norm what it sums, and after the optimizer step `zero_grad()`
starts a fresh accumulation. What a checkpoint, the memory accounting or the replica check needs to know (which
elements' optimizer state this rank holds, which tensors it keeps, whether the parameters are sharded) is asked of
the engine too, so that no caller needs to know which engine is there.

The defaults below are the whole-gradient case (every replica holds the same whole gradients and parameters, the
caller's optimizer updates them); ZeRO overrides what it shards.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from minidist.comm.communicator import Comm
from minidist.parallel.placement import GradPiece, Placement, placement_of


@dataclass(frozen=True)
class OwnedRange:
    """Elements [start, stop) of a parameter's flattened local tensor whose optimizer state this rank holds."""

    name: str
    start: int
    stop: int
    key: torch.Tensor  # what `optimizer.state` is keyed by: the parameter, or ZeRO's view of its slice of the shard
    optimizer: torch.optim.Optimizer | None  # None: no optimizer here holds a state for it
    placement: Placement
    shape: tuple[int, ...]  # the parameter's local shape (ZeRO-3 leaves the parameter itself empty)
    sharded_over: str | None = None  # the group whose ranks own disjoint ranges of it (None: the whole tensor)


class GradSync(ABC):
    """Reduces the gradients of `named` (parameters of `model`) over their replicas; see the module docstring."""

    model: nn.Module
    named: list[tuple[str, nn.Parameter]]  # the (name, parameter) pairs it reduces, in model order

    # -- the step -----------------------------------------------------------------------------------------------------

    @abstractmethod
    def no_sync(self) -> contextlib.AbstractContextManager:
        """Context for the backward passes that only accumulate (the micro-batches before the last)."""

    @abstractmethod
    def finish_grad_sync(self) -> None:
        """Wait until this step's gradients are reduced (launching what is not launched yet)."""

    @abstractmethod
    def zero_grad(self) -> None:
        """After the optimizer step: drop this step's gradients (every parameter's `.grad` becomes None)."""

    @abstractmethod
    def comms(self) -> list[Comm]:
        """The groups the gradients are reduced over (their ledgers hold the bytes the reduction sent)."""

    def grad_pieces(self) -> list[GradPiece]:
        """This rank's reduced gradient as (tensor, placement) pieces, after `finish_grad_sync()`."""
        return [(p.grad, placement_of(p)) for _, p in self.named if p.grad is not None]

    def norm_groups(self) -> dict[str, Comm]:
        """The groups over which `grad_pieces()` are disjoint (none: every replica holds the same gradients)."""
        return {}

    # -- what the engine holds ------------------------------------------------------------------------------------

    @property
    def params_sharded(self) -> bool:
        """Whether the parameters live as disjoint slices over the replicas (ZeRO-3): no replica holds them whole."""
        return False

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers this engine built over its shards (none: the caller's optimizer updates whole
        parameters)."""
        return []

    def owned_ranges(self) -> list[OwnedRange]:
        """The ranges of the parameters whose optimizer state this engine's optimizers hold (none: the caller's)."""
        return []

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Tensors of the model states it keeps besides the parameters and their `.grad`: "params" (flat buffers,
        shards), "grads" (buckets, gradient shards). Views of one storage may repeat: count storages."""
        return {"params": [], "grads": []}

    def param_pieces(self) -> dict[str, torch.Tensor]:
        """The part of each parameter this rank updates, by name (whole parameters here)."""
        return {n: p.detach() for n, p in self.model.named_parameters()}

    # -- whole views (collective under ZeRO) --------------------------------------------------------------------------

    def iter_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, whole value) of this rank's parameters in model order, one at a time."""
        return ((n, p.detach()) for n, p in self.model.named_parameters())

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The reduced gradient of every parameter by name, whole (copies)."""
        self.finish_grad_sync()
        return {n: p.grad.detach().clone() for n, p in self.named if p.grad is not None}


class SingleReplica(GradSync):
    """One replica of every parameter: the gradients are already the step's; nothing to reduce."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def no_sync(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def finish_grad_sync(self) -> None:
        pass

    def zero_grad(self) -> None:
        for _, param in self.named:
            param.grad = None

    def comms(self) -> list[Comm]:
        return []
