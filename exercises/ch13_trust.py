"""Chapter 13 exercises: compare replicas by hash and name the first differing tensor; load a file only after its
size and SHA-256 match what was recorded.

Grade your answers with `make grade CH=13`. The grader checks:
  - first_difference on hash tables of 2 and 4 ranks: None when all agree; the first differing name in name order
    (not in insertion order); the odd rank(s) out against a majority; rank 1 on a tie of two; a one-line ValueError
    when the ranks hold different names;
  - verified_bytes on a real file: the bytes when size and digest match; a ValueError naming the file when it is
    missing, truncated, or has one bit flipped (same size).
"""

from pathlib import Path


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
