"""Data parallelism with expert parallelism: two replica groups (chapter 11).

A dense parameter is replicated over dp_cp and its gradient averaged over it (chapter 07). An expert weight is one
rank's block of experts, replicated over the edp group only, and its gradient is summed over edp and divided by
dp·cp (the gradient rule derived in `minidist.parallel.ep.expert`). So two engines of chapter 07 run side by side on
the same model, each over its own parameters and group:

    dense parameters    DataParallel / ZeroOptimizer over dp_cp     sum / (dp·cp)
    expert parameters   DataParallel / ZeroOptimizer over edp       sum / (dp·cp), ZeRO shards over edp

`ExpertReplicas` holds the pair and answers what `ParallelModel` asks of a gradient reduction (a `GradSync`,
minidist/parallel/grad_sync.py) and, under ZeRO, of an optimizer. The global gradient norm goes through the one
norm function (`placement.grad_norm`): with whole gradients (no ZeRO) a dense gradient is the same on every ep rank
and an expert gradient is not, so squares are summed over ep and each dense piece counts 1/ep (its placement's
"ep" split says ep copies); under ZeRO every piece is a slice, disjoint over dp_cp (= ep × edp), so the squares
are summed over dp_cp.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from minidist.comm.communicator import Comm
from minidist.comm.topology import Topology
from minidist.parallel.dp.data_parallel import AllReduceGrads, DataParallel
from minidist.parallel.dp.zero import ZeroOptimizer
from minidist.parallel.ep.expert import is_expert_param
from minidist.parallel.grad_sync import GradSync, OwnedRange
from minidist.parallel.placement import GradPiece


class ExpertReplicas(GradSync):
    """Dense gradients averaged over dp_cp, expert gradients summed over edp and divided by dp·cp; ZeRO (stage > 0)
    shards each group's optimizer state (and gradients, parameters) over its own group.

    `optimizer` is the unsharded template (e.g. AdamW over the model's param groups), built before the first step.
    At stage 0 it stays the optimizer and this object only reduces gradients; at stages 1-3 this object is also the
    optimizer (each engine rebuilt the template over its own shard)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, topo: Topology, stage: int = 0, *,
                 bucket_bytes: int | None = None) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        experts = [(n, p) for n, p in named if is_expert_param(p)]
        dense = [(n, p) for n, p in named if not is_expert_param(p)]
        dp_cp, edp, replicas = topo.comm("dp_cp"), topo.comm("edp"), topo.size("dp_cp")
        self.model, self.named, self.stage = model, named, stage
        self.engines: list[GradSync]
        if stage > 0:
            self.engines = [ZeroOptimizer(model, optimizer, dp_cp, stage, params=dense, bucket_bytes=bucket_bytes),
                            ZeroOptimizer(model, optimizer, edp, stage, params=experts, grad_divisor=replicas,
                                          bucket_bytes=bucket_bytes)]
            self.norm_comms: dict[str, Comm] = {"dp_cp": dp_cp}
        else:
            self.engines = [DataParallel(model, dp_cp, params=dense, bucket_bytes=bucket_bytes),
                            DataParallel(model, edp, params=experts, reduction=AllReduceGrads(edp, divisor=replicas),
                                         bucket_bytes=bucket_bytes)]
            self.norm_comms = {"ep": topo.comm("ep")}

    # -- the gradient reduction -------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(engine.no_sync())
            yield

    def finish_grad_sync(self) -> None:
        for engine in self.engines:
            engine.finish_grad_sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for engine in self.engines:
            engine.zero_grad()

    def grad_pieces(self) -> list[GradPiece]:
        """This rank's gradient pieces with their placements (after `finish_grad_sync`): ZeRO's slices, or whole
        gradients in model order."""
        if self.stage > 0:
            return [piece for engine in self.engines for piece in engine.grad_pieces()]
        return super().grad_pieces()

    def norm_groups(self) -> dict[str, Comm]:
        """The groups over which `grad_pieces()` are summed (see the module docstring)."""
        return dict(self.norm_comms)

    def comms(self) -> list[Comm]:
        return [comm for engine in self.engines for comm in engine.comms()]

    # -- what the two engines hold ------------------------------------------------------------------------------------

    @property
    def params_sharded(self) -> bool:
        return self.stage == 3

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [optimizer for engine in self.engines for optimizer in engine.optimizers()]

    def owned_ranges(self) -> list[OwnedRange]:
        return [owned for engine in self.engines for owned in engine.owned_ranges()]

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        held = [engine.held_tensors() for engine in self.engines]
        return {kind: [t for h in held for t in h[kind]] for kind in ("params", "grads")}

    # -- the optimizer's face (stages 1-3) ----------------------------------------------------------------------------

    @property
    def param_groups(self) -> list[dict]:
        return [group for engine in self.engines for group in engine.param_groups]

    def step(self) -> None:
        for engine in self.engines:
            engine.step()

    def state_dict(self) -> dict:
        return {"dense": self.engines[0].state_dict(), "experts": self.engines[1].state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.engines[0].load_state_dict(state["dense"])
        self.engines[1].load_state_dict(state["experts"])

    # -- whole views (collective over each engine's group) ------------------------------------------------------------

    def iter_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's parameters (whole dense ones, this rank's block of experts) as (name, value) in model order,
        one at a time (ZeRO-3: one unit of one engine gathered at a time; every rank walks the model in the same
        order, so the two groups' gathers interleave alike on all ranks)."""
        if self.stage == 0:
            yield from super().iter_full_parameters()
            return
        streams = [engine.iter_full_parameters() for engine in self.engines]
        engine_of = {n: i for i, engine in enumerate(self.engines) for n, _ in engine.named}
        for name, _ in self.model.named_parameters():
            if name in engine_of:
                yield next(streams[engine_of[name]])

    def param_pieces(self) -> dict[str, torch.Tensor]:
        """The part of each parameter this rank updates, by name (see `ZeroOptimizer.param_pieces`)."""
        if self.stage == 0:
            return super().param_pieces()
        return {**self.engines[0].param_pieces(), **self.engines[1].param_pieces()}

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """This rank's reduced gradients by name (expert weights: its block), assembled from ZeRO's shards."""
        if self.stage == 0:
            return super().full_gradients()
        return {**self.engines[0].full_gradients(), **self.engines[1].full_gradients()}
