"""Chapter 18 exercises: minidist's records written in PyTorch's vocabulary.

Grade your answers with `make grade CH=18`. The grader holds each answer against `minidist.native` and
`minidist.convert.titan_model` (the package's own versions, which the chapter checks against DTensor, NCCL's byte
counts and torchtitan's Llama 3), case by case, and names the likely cause of a wrong one.
"""

import torch

from minidist.comm.communicator import ring_bytes_sent  # noqa: F401  (the ledger's ring formula: you may use it)
from minidist.model.rope import interleaved_to_half_permutation  # noqa: F401
from minidist.parallel.placement import Placement


def dtensor_placements(placement: Placement, mesh_dims: tuple[str, ...], grad: bool = False) -> tuple:
    """The DTensor placements (torch.distributed.tensor's `Shard(d)`, `Replicate()`, `Partial()`), one per mesh
    dimension in `mesh_dims`, of a parameter that minidist lays out as `placement`.

    `placement.splits` maps a group name ("tp", ...) to a `Split(dim, index, parts, replicas)`: the full tensor
    cut into `parts` equal slices along `dim` over that group, each slice held by `replicas` ranks of it (dim None:
    the whole tensor on every rank of the group). `placement.replicated_over` names groups whose ranks hold the same
    values; "dp_cp" is the dp and cp dimensions together.

    - a split along dim d held once per slice -> Shard(d). A column-parallel nn.Linear splits its weight
      [out_features, in_features] by output rows: its Split says dim 0, so Shard(0) (not Shard(1));
    - a slice held by several ranks of the group (replicas > 1: a kv head shared by tp ranks when there are fewer
      kv heads than tp ranks) has no DTensor placement: raise ValueError (one line, saying why);
    - the gradient (`grad=True`) of a parameter replicated over a dimension is, before its reduction, a different
      summand on each rank of it: Partial() there. Everywhere else (and always for grad=False): Replicate().

    Returns a tuple with one placement per name of `mesh_dims`, in that order.
    """
    raise NotImplementedError


def redistribute_cost(src: str, dst: str, full_shape: tuple[int, ...], element_size: int, p: int
                      ) -> tuple[str | None, int]:
    """The collective a DTensor `redistribute` over one mesh dimension of p ranks runs on NCCL, and the bytes each
    rank sends, for a tensor whose full shape is `full_shape` (its dim 0 divisible by p, every dim by p).

    Placements are written "S0" / "S1" (Shard(0), Shard(1)), "R" (Replicate) and "P" (Partial). Name the collective
    as chapter 00 does: "all_gather", "all_reduce", "reduce_scatter", "all_to_all", or None when nothing is sent
    (Replicate -> Shard: each rank keeps its slice; also a move to itself).

    Bytes sent per rank, ring algorithms, M = the full tensor's bytes (chapter 00, `ring_bytes_sent`):
        all_gather, reduce_scatter   (p − 1)/p · M
        all_reduce                   2 (p − 1)/p · M      (a reduce-scatter, then an all-gather)
        all_to_all (Shard(i) -> Shard(j))   every piece of the local shard (M/p bytes) but the one the rank keeps:
                                     (p − 1)/p · M/p
    Returns (collective, bytes).
    """
    raise NotImplementedError


def to_titan_state(state: dict[str, torch.Tensor], head_dim: int, rope_layout: str) -> dict[str, torch.Tensor]:
    """A minidist Llama-family state dict (one-process names) as torchtitan's Llama 3 holds it.

    Names (torchtitan 0.3.0, the names its `Llama3StateDictAdapter` maps to Hugging Face's):
        tok_emb.weight -> tok_embeddings.weight;  norm.weight, lm_head.weight unchanged;
        blocks.i.attn_norm.weight -> layers.i.attention_norm.weight
        blocks.i.mlp_norm.weight -> layers.i.ffn_norm.weight
        blocks.i.attn.w{q,k,v}.weight -> layers.i.attention.qkv_linear.w{q,k,v}.weight
        blocks.i.attn.wo.weight -> layers.i.attention.wo.weight
        blocks.i.mlp.w{1,2,3}.weight -> layers.i.feed_forward.w{1,2,3}.weight

    RoPE layout: torchtitan rotates the pairs (2i, 2i + 1) of each head ("interleaved", complex numbers). A minidist
    model in the "half" layout (pairs (i, i + d/2)) must have the output rows of W_q and W_k permuted, head by head
    (a weight [heads · head_dim, d] is [heads, head_dim, d]): with p = interleaved_to_half_permutation(head_dim),
    x_half = x_interleaved[p], so x_interleaved = x_half[argsort(p)]. W_v, W_o and the rest are not rotated: leave
    them. A model already "interleaved" needs no permutation.

    Returns a new dict {torchtitan name: tensor}; `state` is not modified.
    """
    raise NotImplementedError
