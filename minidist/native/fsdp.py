"""ZeRO-3 as FSDP2 (torch.distributed.fsdp.fully_shard), the same units, and what each gathers ahead.

minidist's ZeRO-3 (parallel/dp/zero_params.py, `ShardedParams`) and FSDP2 make the same three moves per unit (a
transformer block, and the root: the embedding, final norm and head): all-gather the unit's parameters before its
forward, free them after, all-gather again before its backward and reduce-scatter its gradients. They differ in the
shard: minidist cuts one flat buffer per unit into equal ranges (a parameter may straddle two ranks); FSDP2 cuts
every parameter along dim 0 (`Shard(0)`, the last rank's piece padded), so each shard is a DTensor.

`fully_shard_model` wraps a minidist `Transformer` the way ZeRO-3 groups it (each block a unit, then the root).
`mixed_precision_policy` is FSDP2's form of minidist's `CommPrecision` (the dtype parameters are gathered in, and
the one gradients are reduced in). `gathered_units` observes, as each unit's forward starts, which units have their
full parameters or an all-gather in flight: what each side prefetches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minidist.precision import CommPrecision


def mixed_precision_policy(precision: CommPrecision | None):
    """FSDP2's `MixedPrecisionPolicy` for minidist's communication dtypes (None: fp32 throughout, no policy)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if precision is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=precision.gather_dtype, reduce_dtype=precision.reduce_dtype)


def fully_shard_model(model: nn.Module, mesh, precision: CommPrecision | None = None) -> nn.Module:
    """`fully_shard` every block, then the model (the root unit), on `mesh`: ZeRO-3's units."""
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision_policy(precision)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def prefetch_like_zero3(model: nn.Module) -> None:
    """Set FSDP2's explicit prefetching to what minidist's ZeRO-3 does (`ShardedParams._prefetch_after`): in the
    forward the root and each block start the next block's all-gather; in the backward each block starts the one
    before it (FSDP2's default gathers a block's parameters when its forward starts, and on a CPU nothing runs
    ahead; it prefetches the backward implicitly)."""
    blocks = list(model.blocks)
    model.set_modules_to_forward_prefetch(blocks[:1])
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 2])
        block.set_modules_to_backward_prefetch(blocks[i - 1:i] if i else [])


def local_parameter_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this rank keeps between steps (a DTensor's local shard, padding included)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        local = p._local_tensor if isinstance(p, DTensor) else p
        total += local.untyped_storage().nbytes() if local.numel() else 0
    return total


def fsdp_unit_gathered(module: nn.Module) -> bool:
    """Whether FSDP2 holds this unit's full parameters or has its all-gather in flight (a prefetch)."""
    group = module._get_fsdp_state()._fsdp_param_group
    return group is not None and (group.is_unsharded or group._all_gather_result is not None)


def gathered_units(units: list[nn.Module], is_gathered: Callable[[nn.Module], bool]) -> tuple[list, Callable]:
    """Hooks that append, as unit i's forward starts (after its own gather), the indices of the other units that
    are gathered or being gathered; returns (the record, a function removing the hooks)."""
    record: list[tuple[int, list[int]]] = []

    def hook(i: int):
        def pre_forward(module: nn.Module, args: tuple) -> None:
            record.append((i, [j for j, u in enumerate(units) if j != i and is_gathered(u)]))
        return pre_forward

    handles = [u.register_forward_pre_hook(hook(i)) for i, u in enumerate(units)]
    return record, lambda: [h.remove() for h in handles]


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """{name: full gradient} of an FSDP2 model (an all-gather per parameter: call on every rank)."""
    return {name: p.grad.full_tensor() for name, p in model.named_parameters()}
