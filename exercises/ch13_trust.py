"""Chapter 13 exercises: compare replicas by hash and name the first differing tensor; load a file only after its
size and SHA-256 match what was recorded; then the two checks the trainer runs, built by you: the replica check
(a digest per tensor, the majority of each replica group, the odd rank and tensor named) and the checkpoint
manifest check (every rank file of a checkpoint directory against its meta.json).

Grade your answers with `make grade CH=13`. The grader checks:
  - tensor_digest: equal for equal bytes, different for one flipped bit, for +0.0 vs −0.0 (equal values, different
    bits), for the same bytes in another shape or dtype; equal for two NaNs with the same bits;
  - odd_replicas on per-rank digest tables and replica groups: [] when all agree; each disagreeing (group, tensor,
    odd ranks) by majority — also when rank 0 (or a group's first rank) is the odd one;
  - check_manifest on checkpoint directories written here: the file names when all is well; a one-line ValueError
    naming the file when one is missing, truncated, or has one bit flipped; when meta.json lists fewer files than
    world_size; when a recorded name would leave the directory ("../x"); when meta.json itself is missing;
  - first_difference on hash tables of 2 and 4 ranks: None when all agree; the first differing name in name order
    (not in insertion order); the odd rank(s) out against a majority; rank 1 on a tie of two; a one-line ValueError
    when the ranks hold different names;
  - verified_bytes on a real file: the bytes when size and digest match; a ValueError naming the file when it is
    missing, truncated, or has one bit flipped (same size).
"""

from pathlib import Path

import torch


def first_difference(hashes: list[dict[str, int]]) -> tuple[str, list[int]] | None:
    """Find the first tensor whose copies differ, and the ranks that hold the odd copies.

    `hashes[r]` is rank r's table {tensor name: int64 hash of the tensor's bytes} (chapter 13, §2: what each rank
    all-gathers). Return None if every name has the same hash on every rank. Otherwise return (name, ranks): the
    first differing name in sorted (name) order, so that every rank reports the same tensor whatever order its
    model lists them in, and the ranks whose hash differs from the majority's. With a tie (two copies that
    disagree), the copy of the lowest rank counts as the majority: with two copies no one can tell which is right.
    Raise a one-line ValueError if some rank holds a different set of names (the lists must match before hashes
    can be compared).

    Hints: sorted(table) gives the names in order; collections.Counter counts equal hashes.
    """
    raise NotImplementedError


def verified_bytes(path: str | Path, nbytes: int, sha256: str) -> bytes:
    """Read the file at `path` only if it is what was recorded: exactly `nbytes` bytes whose SHA-256 (lower-case
    hex) is `sha256`; return its bytes.

    Raise a one-line ValueError naming the file when it is missing, when its size differs (a truncated write), or
    when its digest differs (one flipped bit in a file of the right size: the size check alone misses it). This is
    what minidist.train.checkpoint does with each rank file before torch.load(weights_only=True) ever sees it (chapter
    13, §5): a damaged checkpoint is refused in one line instead of loading wrong weights or crashing deep inside
    the unpickler.

    Hints: pathlib.Path.read_bytes; hashlib.sha256(data).hexdigest().
    """
    raise NotImplementedError


def tensor_digest(tensor: torch.Tensor) -> str:
    """A digest (hex string) of the tensor's exact contents: equal for two tensors iff their bytes, shape and dtype
    are equal.

    Replicas must agree *bit for bit* (chapter 13, §2): a comparison of values would call +0.0 and −0.0 equal
    and two NaNs different, and a sum or a norm is blind to two swapped elements. Hash what the memory holds.
    Hint: a tensor's bytes are visible through a uint8 view of a contiguous CPU copy; hashlib hashes bytes.
    """
    raise NotImplementedError("exercise: hash the tensor's bytes, with its shape and dtype")


def odd_replicas(digests: list[dict[str, str]], groups: list[list[int]]) -> list[tuple[int, str, list[int]]]:
    """The replica check: for every replica group and every tensor name, the ranks whose copy is not the majority's.

    digests[r] is rank r's {tensor name: digest}; groups lists the replica groups (the ranks that must hold the same
    copies, e.g. the dp groups), each a list of global ranks. Return [(group index, name, odd ranks)] for every
    (group, name) whose digests disagree, in group order then name order, the odd ranks sorted. An empty list
    means every replica agrees.

    The majority decides which copy is right; the ranks holding any other copy are the odd ones. With no strict
    majority (two copies that disagree, or three different copies) no one can tell, and every rank of the group is
    reported. Do not compare every rank with the group's first rank: if that rank is the damaged one, you
    would blame every healthy rank of the group and clear the culprit.
    """
    raise NotImplementedError("exercise: per group, per name, the majority digest and the ranks that differ")


def check_manifest(directory: str | Path) -> list[str]:
    """Check a checkpoint directory against its manifest before anything is loaded; return the checked file names,
    sorted.

    `directory/meta.json` is the trainer's manifest (minidist.train.checkpoint): {"world_size": W, "files":
    {file name: {"bytes": n, "sha256": hex}}, ...}. Raise a one-line ValueError naming what is wrong when
    meta.json is missing or unreadable, when it lists a number of files other than W (a rank's file missing from
    the manifest), when a name is not a plain file name inside the directory (meta.json is input too: "../x" or
    "/etc/passwd" must never be opened), or when a file fails your verified_bytes.
    """
    raise NotImplementedError("exercise: every rank file against meta.json, names checked before any file is read")
