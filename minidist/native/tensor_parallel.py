"""minidist's tensor-parallel plan (parallel/tp/tensor.py) as a `parallelize_module` plan
(torch.distributed.tensor.parallel), for a minidist `Transformer` on a 1-D tp mesh.

    minidist (chapter 08)                     parallelize_module
    column-parallel wq, wk, wv, w1, w3        ColwiseParallel()          weight Shard(0): output features split
    row-parallel wo, w2                       RowwiseParallel()          weight Shard(1); the output all-reduced
    vocab-parallel embedding                  RowwiseParallel(input_layouts=Replicate())   rows of the table split
    vocab-parallel head + loss                ColwiseParallel(output_layouts=Shard(-1)) under `loss_parallel()`
    sequence parallel (Korthikanti et al.     norms SequenceParallel(); wo, w2 RowwiseParallel(output_layouts=
    2022, "Reducing Activation Recomputation  Shard(1)): a reduce-scatter instead of the all-reduce; attention and
    in Large Transformer Models", §4.2.2)     MLP PrepareModuleInput(Shard(1) -> Replicate()): the all-gather

minidist's column/row linears call `Comm` by hand (the f and g operators); DTensor derives the same collectives
from the placements of the weights and activations.
"""

from __future__ import annotations

from torch import nn


def tp_plan(model: nn.Module, sequence_parallel: bool = False) -> dict:
    """The `parallelize_module` plan of a minidist Transformer: dense SwiGLU blocks, untied head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    act = Shard(1) if sequence_parallel else Replicate()  # the residual stream between blocks
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=act),
            "lm_head": ColwiseParallel(input_layouts=act, output_layouts=Shard(-1), use_local_output=False)}
    if sequence_parallel:
        plan["norm"] = SequenceParallel()
    for i in range(len(model.blocks)):
        b = f"blocks.{i}"
        plan |= {f"{b}.attn.wq": ColwiseParallel(), f"{b}.attn.wk": ColwiseParallel(),
                 f"{b}.attn.wv": ColwiseParallel(), f"{b}.attn.wo": RowwiseParallel(output_layouts=act),
                 f"{b}.mlp.w1": ColwiseParallel(), f"{b}.mlp.w3": ColwiseParallel(),
                 f"{b}.mlp.w2": RowwiseParallel(output_layouts=act)}
        if sequence_parallel:
            plan |= {f"{b}.attn_norm": SequenceParallel(), f"{b}.mlp_norm": SequenceParallel(),
                     f"{b}.attn": PrepareModuleInput(input_layouts=(Shard(1), None),
                                                     desired_input_layouts=(Replicate(), None)),
                     f"{b}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))}
    return plan


def parallelize(model: nn.Module, mesh, sequence_parallel: bool = False) -> nn.Module:
    """`parallelize_module(model, mesh, tp_plan(...))`: the model, its weights now DTensors on `mesh`."""
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, mesh, tp_plan(model, sequence_parallel))


def parallel_loss(logits, targets):
    """Cross-entropy of vocabulary-sharded logits (a DTensor), the mean over tokens, and its backward, under
    `loss_parallel()` (the backward must run inside it too): returns the loss as a float."""
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
    return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()
