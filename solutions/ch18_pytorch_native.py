"""Chapter 18 exercises (answers): minidist's records written in PyTorch's vocabulary.

Grade with `make grade CH=18`.
"""

import torch

from minidist.comm.communicator import ring_bytes_sent
from minidist.model.rope import interleaved_to_half_permutation
from minidist.parallel.placement import Placement


def dtensor_placements(placement: Placement, mesh_dims: tuple[str, ...], grad: bool = False) -> tuple:
    """DTensor placements of a parameter laid out as `placement`, one per mesh dimension (see the exercise)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    replicated = set(placement.replicated_over)
    if "dp_cp" in replicated:
        replicated |= {"dp", "cp"}
    out = []
    for name in mesh_dims:
        split = placement.splits.get(name)
        if split is not None and split.dim is not None:
            if split.replicas != 1:
                raise ValueError(f"a slice held by {split.replicas} ranks of {name!r} has no DTensor placement")
            out.append(Shard(split.dim))
        elif grad and name in replicated:
            out.append(Partial())
        else:
            out.append(Replicate())
    return tuple(out)


def redistribute_cost(src: str, dst: str, full_shape: tuple[int, ...], element_size: int, p: int
                      ) -> tuple[str | None, int]:
    """(collective, bytes each rank sends) of a DTensor redistribute over p ranks on NCCL (see the exercise)."""
    kinds = (src[0], dst[0])
    numel = 1
    for s in full_shape:
        numel *= s
    if kinds == ("S", "R"):
        return "all_gather", ring_bytes_sent("all_gather", full_shape, element_size, p, 0)
    if kinds == ("P", "R"):
        return "all_reduce", ring_bytes_sent("all_reduce", full_shape, element_size, p, 0)
    if kinds == ("P", "S"):
        return "reduce_scatter", ring_bytes_sent("reduce_scatter", full_shape, element_size, p, 0)
    if kinds == ("S", "S") and src != dst:
        local = numel // p * element_size
        return "all_to_all", local - local // p
    return None, 0


TITAN_TOP = {"tok_emb.weight": "tok_embeddings.weight", "norm.weight": "norm.weight",
             "lm_head.weight": "lm_head.weight"}
TITAN_BLOCK = {"attn_norm.weight": "attention_norm.weight", "mlp_norm.weight": "ffn_norm.weight",
               "attn.wq.weight": "attention.qkv_linear.wq.weight", "attn.wk.weight": "attention.qkv_linear.wk.weight",
               "attn.wv.weight": "attention.qkv_linear.wv.weight", "attn.wo.weight": "attention.wo.weight",
               "mlp.w1.weight": "feed_forward.w1.weight", "mlp.w2.weight": "feed_forward.w2.weight",
               "mlp.w3.weight": "feed_forward.w3.weight"}


def to_titan_state(state: dict[str, torch.Tensor], head_dim: int, rope_layout: str) -> dict[str, torch.Tensor]:
    """A minidist Llama state under torchtitan's names, q/k rows in the interleaved layout (see the exercise)."""
    back = torch.argsort(interleaved_to_half_permutation(head_dim))  # x_interleaved = x_half[back]
    out = {}
    for name, value in state.items():
        if name.startswith("blocks."):
            _, i, rest = name.split(".", 2)
            titan = f"layers.{i}.{TITAN_BLOCK[rest]}"
            if rope_layout == "half" and rest in ("attn.wq.weight", "attn.wk.weight"):
                value = value.reshape(-1, head_dim, value.shape[-1])[:, back, :].reshape(value.shape)
        else:
            titan = TITAN_TOP[name]
        out[titan] = value.clone()
    return out
