"""Which tokens of a sequence each context-parallel rank holds, and the way back (chapter 10).

A sequence of T tokens is cut into chunks. Two layouts over cp ranks:

- contiguous: cp chunks of T/cp; rank r holds chunk r. Under a causal mask the last rank's queries see the whole
  sequence and the first rank's see only their own chunk: the work per rank grows with r.
- zigzag: 2·cp chunks of T/(2·cp); rank r holds chunks r and 2·cp−1−r, one from each end, so every rank does the
  same work (Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.2; Megatron-LM's context parallelism too).

Written as chunk rearrangements: zig-zag splits the sequence in two halves of cp chunks, reverses the second half,
and gives rank r chunk r of each half. Everything here acts on one dimension of any tensor (tokens, targets,
positions, activations), so the index maps are the functions applied to `arange(T)`.
"""

from __future__ import annotations

import torch
from einops import rearrange

LAYOUTS = ("contiguous", "zigzag")


def chunks_per_rank(layout: str) -> int:
    """How many equal chunks each rank holds (the unit of the causal mask's block structure)."""
    _check(layout)
    return 2 if layout == "zigzag" else 1


def shard_all(x: torch.Tensor, cp: int, layout: str, dim: int = 0) -> torch.Tensor:
    """Every rank's shard of `x` along `dim`, stacked: [cp, ...] with the shard's tokens in place of `dim`."""
    _check(layout)
    x = x.movedim(dim, 0)
    if layout == "contiguous":
        shards = rearrange(x, "(r n) ... -> r n ...", r=cp)
    else:
        halves = rearrange(x, "(h r n) ... -> h r n ...", h=2, r=cp)  # two halves of cp chunks each
        halves = torch.stack([halves[0], halves[1].flip(0)])  # the second half's chunks in reverse order
        shards = rearrange(halves, "h r n ... -> r (h n) ...")  # rank r: chunk r of each half
    return shards.movedim(1, dim + 1)


def unshard_all(shards: torch.Tensor, layout: str, dim: int = 0) -> torch.Tensor:
    """The inverse of `shard_all`: [cp, ...shard...] -> the whole sequence along `dim`, in order."""
    _check(layout)
    shards = shards.movedim(dim + 1, 1)
    if layout == "contiguous":
        whole = rearrange(shards, "r n ... -> (r n) ...")
    else:
        halves = rearrange(shards, "r (h n) ... -> h r n ...", h=2)
        halves = torch.stack([halves[0], halves[1].flip(0)])
        whole = rearrange(halves, "h r n ... -> (h r n) ...")
    return whole.movedim(0, dim)


def shard_sequence(x: torch.Tensor, rank: int, cp: int, layout: str, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s tokens of `x` along `dim` (default 1: [batch, seq, ...]), contiguous in memory."""
    return shard_all(x, cp, layout, dim)[rank].contiguous()


def shard_positions(seq_len: int, rank: int, cp: int, layout: str, device: torch.device | None = None
                    ) -> torch.Tensor:
    """The global positions of rank `rank`'s tokens: what RoPE and learned position embeddings must see."""
    return shard_sequence(torch.arange(seq_len, device=device), rank, cp, layout, dim=0)


def shard_spans(seq_len: int, rank: int, cp: int, layout: str) -> list[range]:
    """The global positions of rank `rank`'s chunks, in the order it holds them, as Python ranges: what the causal
    mask's block decisions need, known on the host without reading a tensor (`shard_positions`, as ranges)."""
    parts = cp * chunks_per_rank(layout)
    size = seq_len // parts
    chunks = [rank] if layout == "contiguous" else [rank, parts - 1 - rank]
    return [range(c * size, (c + 1) * size) for c in chunks]


def check_divisible(seq_len: int, cp: int, layout: str) -> None:
    """One-line ValueError unless `seq_len` splits into this layout's equal chunks."""
    parts = cp * chunks_per_rank(layout)
    if seq_len % parts:
        what = "2·cp chunks (zig-zag)" if layout == "zigzag" else "cp chunks"
        raise ValueError(f"seq_len={seq_len} does not split into {what} = {parts}; pick a multiple of {parts}")


def _check(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; choose one of {LAYOUTS}")
