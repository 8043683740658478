"""Replica checks: the tensors that several ranks must hold bit for bit, compared across those ranks.

A data-parallel job keeps many copies of the same numbers: every dp·cp replica holds the same parameters (ZeRO
0-2), every tp rank of a group holds the same norm weights, every edp rank the same experts. Nothing in training
compares them: a flipped bit in one copy (silent data corruption, a real hazard at scale: the Llama 3 paper, 2024,
§3.3.4, counts it among the causes of its interruptions) changes the loss too little to see, and the copies drift
apart for good. Megatron-Core checks this the same way: it hashes the parameters on each data-parallel rank and
compares the hashes across them (its "replica hash" checks of parameter state).

What to compare comes from each parameter's placement record (`minidist.parallel.placement`), never from module
types:

- `replicated_over` (dp_cp, or edp for experts): every rank of that group holds the same tensor, except under
  ZeRO-3, where each rank holds only its own slice of the parameters: no parameter has a replica to compare;
- a split whose `dim` is None (a tp-replicated norm weight): every rank of that group holds the whole tensor (under
  ZeRO-3, the same slice of it: the ranks of a tp group shard equal local shapes in the same bucket layout, so
  they own the same element ranges, and those slices are compared);
- a split with `replicas` > 1 (a key/value head shared by several tp ranks): the ranks with the same slice index.

Persistent buffers (model state, e.g. the MoE router bias) are compared over dp_cp, whose ranks run the same
modules by construction; non-persistent buffers are per-rank scratch (this rank's expert counts) and may differ.

Each rank hashes every tensor to one int64 on its device (`device_digest`: no copy of the parameters to the host,
which for an 8B replica would be 32 GB per check), all-gathers the hashes over the group through its Comm, and
compares them on the host: one int64 per tensor per rank travels, never the tensor, and one small read per group.
"""

from __future__ import annotations

import hashlib
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from minidist.comm.communicator import Comm
from minidist.comm.topology import Topology
from minidist.parallel import ParallelModel
from minidist.parallel.placement import placement_of
from minidist.trust.health import TrainingDiverged


class ReplicasDiffer(TrainingDiverged):
    """Tensors that must be identical on several ranks are not."""


@dataclass(frozen=True)
class Entry:
    """One tensor to compare over one group; ranks compare only with the ranks that have the same `key`."""

    name: str
    tensor: torch.Tensor
    key: int = 0


PRIME = 2**31 - 1  # the digest's modulus: a product of two residues fits an int64
CHUNK_WORDS = 1 << 22  # words hashed per pass: bounds the digest's scratch (a few int64 copies of a chunk)


def device_digest(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, with its shape and dtype, as one int64 computed where the tensor lives (0-d, same device).

    Two sums over the tensor's 32-bit words w_i, mod p = 2^31 − 1: Σ w_i·a_i and Σ w_i·b_i, with position weights
    a_i = i mod (p−1) + 1 and b_i = 65537·i mod (p−1) + 1 (65537 is prime to p−1, so both run over 1..p−1). One
    flipped bit changes w_i by ±2^j (j < 32), so each sum by ±2^j·a_i mod p, never 0 (p is prime and does not
    divide 2^j or a_i): a single flipped bit always changes the digest. Integer sums are exact in any order, so
    replicas with equal bytes get equal digests on any device; for unequal bytes a collision is about 2^-62."""
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    if data.numel() % 4 or data.storage_offset() % 4:  # whole, aligned words: pad with zero bytes
        data = torch.cat([data, data.new_zeros(-data.numel() % 4)])
    words = data.view(torch.int32)
    sums = torch.zeros(2, dtype=torch.int64, device=tensor.device)
    for start in range(0, words.numel(), CHUNK_WORDS):
        w = words[start:start + CHUNK_WORDS].to(torch.int64).bitwise_and_(0xFFFFFFFF).remainder_(PRIME)
        i = torch.arange(start, start + w.numel(), dtype=torch.int64, device=tensor.device)
        weights = torch.stack([i, i * 65537]).remainder_(PRIME - 1).add_(1)
        sums = (sums + (w * weights).remainder_(PRIME).sum(dim=1)).remainder_(PRIME)
    meta = int.from_bytes(hashlib.sha256(f"{tuple(tensor.shape)}{tensor.dtype}".encode()).digest()[:8]) >> 2
    return (sums[0] * (PRIME + 1) + sums[1]).bitwise_xor_(meta)  # < 2^62: an int64, folded with shape and dtype


def tensor_hash(tensor: torch.Tensor) -> int:
    """`device_digest` read on the host: equal for equal bytes (shape and dtype included), different for any single
    flipped bit."""
    return int(device_digest(tensor))


def replica_entries(model: nn.Module, params_sharded: bool = False,
                    pieces: dict[str, torch.Tensor] | None = None) -> dict[str, list[Entry]]:
    """{group: the tensors of this rank that other ranks of that group also hold}, each list in name order.

    `params_sharded` (ZeRO-3): the parameters live as disjoint slices over dp_cp, so replicated_over is ignored, and
    `pieces` holds this rank's slice of each parameter by name (`ParallelModel.param_pieces`), compared in its
    place (the model's parameters are empty tensors between gathers)."""
    entries: dict[str, list[Entry]] = defaultdict(list)
    for name, param in sorted(model.named_parameters()):
        placement = placement_of(param)
        tensor = pieces[name] if pieces is not None else param
        if not params_sharded:
            for group in placement.replicated_over:
                entries[group].append(Entry(name, tensor))
        for group, split in placement.splits.items():
            if split.dim is None or split.replicas > 1:
                entries[group].append(Entry(name, tensor, split.index))
    persistent = set(model.state_dict())
    for name, buffer in sorted(model.named_buffers()):
        if name in persistent:
            entries["dp_cp"].append(Entry(name, buffer))
    return dict(entries)


def replicated_names(model: nn.Module, params_sharded: bool = False) -> list[str]:
    """Parameters (in name order) of which some other rank holds an identical copy."""
    params = dict(model.named_parameters())
    names = {e.name for group in replica_entries(model, params_sharded).values() for e in group}
    return sorted(names & set(params))


def compare(group: str, entries: list[Entry], comm: Comm) -> None:
    """All-gather each entry's hash over `comm`; raise ReplicasDiffer naming the ranks and the first differing
    tensor (in name order). Collective over the group: every member calls it with the same names."""
    counts = comm.all_gather(torch.tensor([len(entries)], dtype=torch.int64, device=comm.device))
    if len(set(counts.tolist())) > 1:
        raise ReplicasDiffer(f"replicas differ over {group}: ranks {comm.ranks} hold {counts.tolist()} tensors "
                             "that should be replicated")
    keys = torch.tensor([e.key for e in entries], dtype=torch.int64, device=comm.device)  # host numbers: one copy
    mine = torch.cat([torch.stack([device_digest(e.tensor).to(comm.device) for e in entries]), keys]) if entries \
        else keys
    rows = comm.all_gather(mine)
    rows = rows.reshape(comm.size, 2 * len(entries)).tolist()
    for i, entry in enumerate(entries):
        classes: dict[int, list[int]] = defaultdict(list)  # slice key -> group ranks holding that slice
        for r, row in enumerate(rows):
            classes[row[len(entries) + i]].append(r)
        for members in classes.values():
            hashes = Counter(rows[r][i] for r in members)
            if len(hashes) > 1:
                majority = max(hashes, key=lambda h: (hashes[h], -min(r for r in members if rows[r][i] == h)))
                odd = [comm.global_rank(r) for r in members if rows[r][i] != majority]
                rest = [comm.global_rank(r) for r in members if rows[r][i] == majority]
                # With a majority, the odd ranks are the likely culprits; with a tie, no one can tell which is right.
                verb = "disagree with" if len(rest) > len(odd) else "and"
                first, second = (odd, rest) if verb != "and" else sorted((odd, rest))
                raise ReplicasDiffer(f"replicas differ over {group}: rank(s) {first} {verb} rank(s) {second} "
                                     f"on {entry.name} (the first differing tensor, in name order)")


def check_replicas(model: nn.Module, comms: dict[str, Comm], params_sharded: bool = False,
                   when: str = "", pieces: dict[str, torch.Tensor] | None = None) -> None:
    """Compare every replicated tensor over its group; `comms` holds this rank's Comm of every group of size > 1
    that may appear in a placement. Every rank of the job calls it, with the same groups in the same order.
    `pieces`: under ZeRO-3, this rank's slices of the parameters by name (see `replica_entries`)."""
    entries = replica_entries(model, params_sharded, pieces)
    # A group no placement names (edp without experts) has no entries on any of its ranks: nothing to compare.
    for group in sorted(set(comms) & set(entries)):
        try:
            compare(group, entries[group], comms[group])
        except ReplicasDiffer as e:
            raise ReplicasDiffer(f"{when}: {e}" if when else str(e)) from None


def replica_comms(topo: Topology) -> dict[str, Comm]:
    """The Comms of the groups a placement can name (dp_cp, edp, tp, tied), those with more than one rank."""
    return {name: topo.comm(name) for name in ("dp_cp", "edp", "tp", "tied") if topo.size(name) > 1}


def check_model(parallel: ParallelModel, when: str) -> None:
    """The trainer's check of this rank's `ParallelModel`: every copy of a replicated tensor bitwise identical.
    Under ZeRO-3 no parameter has a dp_cp copy (each rank holds its own slice); the slices of tp-replicated ones
    and the buffers are still compared. Every rank of the job calls it."""
    sharded = parallel.params_sharded
    pieces = parallel.param_pieces() if sharded else None
    check_replicas(parallel.model, replica_comms(parallel.topo), sharded, when, pieces)
