"""Context parallelism as a transformation of a built model (chapter 10): swap every attention core, and give each
cp rank its tokens of every sequence with their global positions.

Everything outside attention acts on each token alone (norms, MLPs, MoE routing, the loss), so a rank can run it
on its share of the sequence; only attention mixes tokens. `apply_context_parallel` therefore replaces the
parameterless core of each attention module (`minidist.model.attention.CausalAttention`, which sees q, k, v after
the projections and RoPE) by a `ContextParallelAttention` of the chosen variant, and returns the `ContextParallel`
step that shards micro-batches:

    ring       keys/values travel around the ring, overlapped with compute (`ring.py`); zig-zag layout
    allgather  all-gather keys/values, reduce-scatter their gradients (`allgather.py`); zig-zag layout
    ulysses    all-to-all sequence <-> heads around ordinary attention (`ulysses.py`); contiguous layout (every rank
               does the same work whatever the layout, so the causal order needs no reshuffling)

With multi-head latent attention the core receives the expanded per-head keys and values, so those travel, not the
compressed latent (the notebook counts what sending the latent would save, and what it would cost). Mixture of
experts routes each token alone, but its sequence-wise balance loss counts a whole sequence's routing decisions:
each MoE layer gets `seq_reduce`, an all-reduce over cp of those counts (its router probabilities stay local, and
the gradient average over dp×cp divides their cp-fold share back), which keeps the loss exact. An expert's capacity
ranks the slots of a whole sequence by position, so MoE with a capacity factor is refused.

Gradients: each cp rank's parameter gradients are partial sums over its tokens, so they are reduced over dp×cp (the
dp_cp group) exactly as data parallelism reduces over replicas; the loss is normalized by the global token count.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from minidist.comm.communicator import Comm
from minidist.model.attention import CausalAttention
from minidist.model.config import ModelConfig
from minidist.model.documents import Documents
from minidist.model.moe.layer import MoELayer
from minidist.parallel.cp.allgather import allgather_attention, gathered_positions
from minidist.parallel.cp.blockwise import Work, in_autocast_dtype
from minidist.parallel.cp.ring import ring_attention
from minidist.parallel.cp.sharding import check_divisible, shard_positions, shard_sequence
from minidist.parallel.cp.ulysses import ulysses_attention

IMPLS = ("ring", "allgather", "ulysses")
LAYOUT_OF = {"ring": "zigzag", "allgather": "zigzag", "ulysses": "contiguous"}
Batches = list[tuple[torch.Tensor, torch.Tensor]]


def kv_heads_per_rank(cfg: ModelConfig, tp: int = 1) -> int:
    """Key/value heads a tp rank's attention core receives: MLA's keys are per head; GQA's kv heads are split over
    tp, or replicated (one per rank) when there are fewer than tp."""
    if cfg.attention == "mla":
        return cfg.n_heads // tp
    return cfg.n_kv_heads // tp if cfg.n_kv_heads % tp == 0 else 1


def validate_context_parallel(cfg: ModelConfig, cp: int, impl: str = "ring", seq_len: int | None = None,
                              tp: int = 1, sequence_parallel: bool = False) -> None:
    """One-line ValueError unless this model and sequence can be split over cp ranks with `impl`. Needs no group."""
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp must be a positive integer, got {cp!r}")
    if impl not in IMPLS:
        raise ValueError(f"unknown context-parallel implementation {impl!r}; choose one of {IMPLS}")
    if cp == 1:
        return
    if cfg.moe.n_experts > 0 and cfg.moe.capacity_factor is not None:
        raise ValueError(f"cp={cp} with MoE capacity_factor={cfg.moe.capacity_factor}: an expert's capacity ranks the "
                         "slots of a whole sequence by position, which no cp rank holds; use capacity_factor None "
                         "(dropless)")
    if seq_len is not None:
        check_divisible(seq_len, cp, LAYOUT_OF[impl])
        if sequence_parallel and (seq_len // cp) % tp:
            raise ValueError(f"sequence parallel splits each cp rank's {seq_len // cp} tokens over tp={tp}: pick "
                             f"seq_len divisible by cp·tp and by the layout's chunks (e.g. {2 * cp * tp})")
    if impl == "ulysses":
        heads, kv = cfg.n_heads // tp, kv_heads_per_rank(cfg, tp)
        if heads % cp:
            raise ValueError(f"ulysses splits the {heads} attention heads per tp rank over cp={cp}: cp must divide "
                             "them; use --cp-impl ring or allgather")
        if kv % cp and cp % kv:
            raise ValueError(f"ulysses: the {kv} kv heads per tp rank neither split over cp={cp} nor replicate "
                             "evenly onto it; use --cp-impl ring or allgather")


class ContextParallelAttention(nn.Module):
    """The attention core of one block, over the tokens of all the cp ranks of `comm`. `work` counts the unmasked
    scores this rank computed (ring and allgather)."""

    def __init__(self, comm: Comm, impl: str = "ring", layout: str | None = None) -> None:
        super().__init__()
        if impl not in IMPLS:
            raise ValueError(f"unknown context-parallel implementation {impl!r}; choose one of {IMPLS}")
        self.comm, self.impl, self.layout = comm, impl, layout or LAYOUT_OF[impl]
        self.work = Work()

    def prepare_documents(self, docs: Documents) -> None:
        """Build the mask this core reads, before the blocks (outside any compiled block): Ulysses attends over the
        whole sequence (its mask); all-gather on CUDA its queries against the gathered keys; the ring masks each
        block pair itself."""
        if self.impl == "ulysses":
            docs.flex_mask()
        elif self.impl == "allgather" and docs.ids.device.type == "cuda":
            docs.gathered_mask(functools.partial(gathered_positions, docs.ids.shape[1], self.comm.rank,
                                                 self.comm.size, self.layout, docs.ids.device))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                docs: Documents | None = None) -> torch.Tensor:
        """`docs`: the document ids of the whole sequence (every cp rank holds them), None for plain causal."""
        if self.impl in ("ring", "allgather"):  # the blocks on CUDA: FlashAttention in the autocast dtype
            q, k, v = in_autocast_dtype(q, k, v)
        ids = docs.ids if docs is not None else None
        if self.impl == "ring":
            return ring_attention(q, k, v, self.comm, self.layout, scale, self.work, ids)
        if self.impl == "allgather":
            return allgather_attention(q, k, v, self.comm, self.layout, scale, self.work, docs)
        return ulysses_attention(q, k, v, self.comm, self.layout, scale, docs)


@dataclass
class ContextParallel:
    """The step's side of context parallelism: which tokens of each micro-batch this rank keeps."""

    comm: Comm
    impl: str
    layout: str

    def shard(self, batches: Batches, positions: list[torch.Tensor] | None = None
              ) -> tuple[Batches, list[torch.Tensor]]:
        """This rank's tokens of every (inputs, targets) [B, T] and their global positions [T/cp], or their share
        of the given per-row `positions` [B, T] (positions within documents: RoPE's, not causality's)."""
        rank, cp = self.comm.rank, self.comm.size
        local, shared = [], []
        for i, (inputs, targets) in enumerate(batches):
            check_divisible(inputs.shape[1], cp, self.layout)
            local.append((shard_sequence(inputs, rank, cp, self.layout), shard_sequence(targets, rank, cp,
                                                                                        self.layout)))
            shared.append(shard_positions(inputs.shape[1], rank, cp, self.layout, inputs.device) if positions is None
                          else shard_sequence(positions[i], rank, cp, self.layout))
        return local, shared


def apply_context_parallel(model: nn.Module, comm: Comm, impl: str = "ring", layout: str | None = None
                           ) -> ContextParallel:
    """Swap every attention core of `model` (in place) for one that attends over the cp ranks of `comm`."""
    layout = layout or LAYOUT_OF.get(impl)
    swapped = 0
    for module in list(model.modules()):
        if isinstance(getattr(module, "core", None), CausalAttention):
            module.core = ContextParallelAttention(comm, impl, layout)
            swapped += 1
        if isinstance(module, MoELayer):  # its balance loss counts each sequence's slots on every cp rank
            module.seq_reduce = comm.all_reduce
    if swapped == 0:
        raise ValueError("context parallelism found no attention core (CausalAttention) to swap in this model")
    return ContextParallel(comm, impl, layout)


def attention_cores(model: nn.Module) -> list[ContextParallelAttention]:
    return [m for m in model.modules() if isinstance(m, ContextParallelAttention)]
