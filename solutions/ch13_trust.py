"""Chapter 13 exercises (reference answers): compare replicas by hash and name the first differing tensor; load a
file only after its size and SHA-256 match what was recorded; a tensor's digest, the replica check by majority,
and the checkpoint manifest check."""

import hashlib
import json
from collections import Counter
from pathlib import Path

import torch


def first_difference(hashes: list[dict[str, int]]) -> tuple[str, list[int]] | None:
    """See exercises/ch13_trust.py."""
    if not hashes:
        return None
    names = sorted(hashes[0])
    for rank, table in enumerate(hashes):
        if sorted(table) != names:
            raise ValueError(f"rank {rank} holds {sorted(table)}, rank 0 holds {names}")
    for name in names:
        values = [table[name] for table in hashes]
        counts = Counter(values)
        if len(counts) > 1:
            best = max(counts.values())
            majority = next(v for v in values if counts[v] == best)  # ties: the lowest rank's value
            return name, [rank for rank, v in enumerate(values) if v != majority]
    return None


def verified_bytes(path: str | Path, nbytes: int, sha256: str) -> bytes:
    """See exercises/ch13_trust.py."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} is missing")
    data = path.read_bytes()
    if len(data) != nbytes:
        raise ValueError(f"{path} has {len(data)} bytes, expected {nbytes}")
    if hashlib.sha256(data).hexdigest() != sha256:
        raise ValueError(f"{path} does not match the recorded SHA-256")
    return data


def tensor_digest(tensor: torch.Tensor) -> str:
    """See exercises/ch13_trust.py."""
    t = tensor.detach().to("cpu").contiguous()
    digest = hashlib.sha256(f"{tuple(t.shape)} {t.dtype};".encode())  # same bytes in another shape differ
    digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def odd_replicas(digests: list[dict[str, str]], groups: list[list[int]]) -> list[tuple[int, str, list[int]]]:
    """See exercises/ch13_trust.py."""
    found = []
    for index, group in enumerate(groups):
        for name in sorted(set().union(*(digests[r] for r in group))):
            copies = {r: digests[r].get(name) for r in group}
            counts = Counter(copies.values())
            if len(counts) == 1:
                continue
            value, top = counts.most_common(1)[0]
            strict = top * 2 > len(group)  # a strict majority decides; otherwise nobody knows which copy is right
            found.append((index, name, sorted(r for r, v in copies.items() if not strict or v != value)))
    return found


def check_manifest(directory: str | Path) -> list[str]:
    """See exercises/ch13_trust.py."""
    directory = Path(directory)
    try:
        meta = json.loads((directory / "meta.json").read_text())
        files, world = meta["files"], int(meta["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{directory / 'meta.json'} is missing or unreadable ({type(e).__name__})") from None
    if len(files) != world:
        raise ValueError(f"{directory / 'meta.json'} lists {len(files)} files for world_size {world}")
    for name in files:  # every name before any file is opened: meta.json is untrusted input
        if Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"{directory / 'meta.json'} names {name!r}, not a file inside {directory}")
    for name, record in sorted(files.items()):
        verified_bytes(directory / name, record["bytes"], record["sha256"])
    return sorted(files)
