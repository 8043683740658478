"""Grade chapter 13's exercises: naming the first differing replica tensor, and a checksum-verified read.

`pytest tests/exercises -k ch13` grades solutions/ (the default); add `--impl exercises` to grade your own answers
(`make grade CH=13`). The oracles are tables built here with a known difference, and a real file damaged here.
"""

import hashlib
import json

import pytest
import torch
from grading import load

MODULE = "ch13_trust"


def test_ch13_first_difference(impl: str) -> None:
    first_difference = load(impl, MODULE, "first_difference")
    same = {"w": 1, "b": 2, "norm": 3}
    assert first_difference([same, dict(same)]) is None, "first_difference: identical tables must give None"
    # rank 2 differs on "b" and "w": "b" comes first in name order although "w" was inserted first
    odd = {"w": 9, "b": 8, "norm": 3}
    got = first_difference([same, same, odd, same])
    assert got == ("b", [2]), f"first_difference: expected ('b', [2]) (name order, the odd rank), got {got}"
    got = first_difference([odd, same, same])
    assert got == ("b", [0]), (
        f"first_difference, rank 0 is the odd copy of three: expected ('b', [0]), got {got} — "
        + ("you compared every rank with rank 0; the majority decides which copy is right"
           if got == ("b", [1, 2]) else "the ranks whose hash differs from the majority's"))
    got = first_difference([same, {"w": 1, "b": 2, "norm": 4}])
    assert got == ("norm", [1]), f"first_difference: a tie of two copies counts rank 0 as the majority, got {got}"
    with pytest.raises(ValueError) as info:
        first_difference([same, {"w": 1, "b": 2}])
    assert "\n" not in str(info.value), "first_difference: the error must be one line"


def test_ch13_verified_bytes(impl: str, tmp_path) -> None:
    verified_bytes = load(impl, MODULE, "verified_bytes")
    path = tmp_path / "rank0.pt"
    data = bytes(range(256)) * 40
    path.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    assert verified_bytes(path, len(data), digest) == data, "verified_bytes: a good file must be returned as is"
    damaged = bytearray(data)
    damaged[len(data) // 2] ^= 0x01
    causes = {"one bit flipped (same size)": "the size check alone cannot see a flipped bit: compare the SHA-256 of "
                                            "the bytes with the recorded one",
              "truncated": "compare the file's size with the recorded one"}
    for what, content in (("one bit flipped (same size)", bytes(damaged)), ("truncated", data[:100])):
        path.write_bytes(content)
        refused = _refusal(verified_bytes, path, len(data), digest)
        if refused is None:
            pytest.fail(f"verified_bytes, case {what!r}: returned the bytes of a damaged file — {causes[what]}",
                        pytrace=False)
        assert str(path) in refused and "\n" not in refused, (
            f"verified_bytes, case {what!r}: refuse in one line naming the file, got {refused!r}")
    path.unlink()
    refused = _refusal(verified_bytes, path, len(data), digest)
    assert refused is not None and "missing" in refused, \
        f"verified_bytes, case 'missing file': expected a ValueError saying it is missing, got {refused!r}"


def _refusal(fn, *args) -> str | None:
    """The ValueError's message, or None if `fn` returned; any other exception fails with its cause named."""
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"{type(e).__name__} ({e}) instead of a one-line ValueError — check before you read or parse",
                    pytrace=False)
    return None


# ------------------------------------------------------------------------------------------------------------------
# tensor_digest


def test_ch13_tensor_digest_sees_every_bit(impl: str) -> None:
    digest = load(impl, MODULE, "tensor_digest")
    g = torch.Generator().manual_seed(13)
    w = torch.randn(4, 6, generator=g)
    assert digest(w) == digest(w.clone()), "tensor_digest: two copies of the same tensor must give the same digest"
    flipped = w.clone()
    flipped.view(torch.int32)[2, 3] ^= 1 << 16  # mantissa bit 16: the value changes by 0.4-0.8 %
    cases = {
        "one mantissa bit flipped": (w, flipped, "hash the bytes, not a rounded value"),
        "two elements swapped": (w, w[:, [1, 0, 2, 3, 4, 5]], "a sum or a norm is blind to order: hash every byte"),
        "+0.0 vs -0.0": (torch.zeros(3), -torch.zeros(3),
                         "equal values, different bits: a value comparison (==) calls them equal; hash the bytes"),
        "same bytes, other shape": (w, w.reshape(6, 4), "put the shape into the digest"),
        "same bytes, other dtype": (w.view(torch.int32), w, "put the dtype into the digest"),
    }
    for case, (a, b, cause) in cases.items():
        assert digest(a) != digest(b), f"tensor_digest, case {case!r}: equal digests — {cause}"
    nan = torch.tensor([float("nan"), 1.0])
    assert digest(nan) == digest(nan.clone()), (
        "tensor_digest, case 'the same NaN twice': different digests — NaN != NaN as a value, but the bits are equal")
    strided = w.t()
    assert digest(strided) == digest(strided.contiguous()), (
        "tensor_digest, case 'a transposed view vs its contiguous copy': different digests — hash the elements in "
        "logical order (a contiguous copy), not the storage underneath")


# ------------------------------------------------------------------------------------------------------------------
# odd_replicas

A, B, C = "aa", "bb", "cc"
REPLICA_CASES = [
    ("all agree", [{"w": A, "b": B}] * 4, [[0, 1], [2, 3]], []),
    ("rank 0 is the odd copy of three", [{"w": C}, {"w": A}, {"w": A}], [[0, 1, 2]], [(0, "w", [0])]),
    ("a group's first rank is odd", [{"w": A}, {"w": A}, {"w": C}, {"w": B}, {"w": B}],
     [[0, 1], [2, 3, 4]], [(1, "w", [2])]),
    ("two names, name order", [{"z": A, "a": A}, {"z": C, "a": C}, {"z": A, "a": A}], [[0, 1, 2]],
     [(0, "a", [1]), (0, "z", [1])]),
    ("a tie of two: nobody knows which copy is right", [{"w": A}, {"w": B}], [[0, 1]], [(0, "w", [0, 1])]),
    ("groups that are not contiguous", [{"w": A}, {"w": A}, {"w": A}, {"w": B}, {"w": A}, {"w": A}],
     [[0, 2, 4], [1, 3, 5]], [(1, "w", [3])]),
    ("the same odd copy in two groups is two findings", [{"w": B}, {"w": A}, {"w": A}, {"w": B}, {"w": A}, {"w": A}],
     [[0, 1, 2], [3, 4, 5]], [(0, "w", [0]), (1, "w", [3])]),
]


@pytest.mark.parametrize("case,digests,groups,want", REPLICA_CASES, ids=[c[0] for c in REPLICA_CASES])
def test_ch13_odd_replicas(impl: str, case: str, digests, groups, want) -> None:
    odd_replicas = load(impl, MODULE, "odd_replicas")
    got = [(int(g), str(n), sorted(int(r) for r in ranks)) for g, n, ranks in odd_replicas(digests, groups)]
    if got == want:
        return
    hint = " — with no strict majority nobody can tell which copy is right: report every rank of the group" \
        if "tie" in case else ""
    first_rank = [(i, n, sorted(r for r in grp if digests[r][n] != digests[grp[0]][n]))
                  for i, grp in enumerate(groups) for n in sorted(digests[grp[0]])]
    if hint:
        pass
    elif got == [f for f in first_rank if f[2]]:
        hint = " — you compared every rank with its group's first rank; the majority of the group decides"
    elif any(r not in groups[g] for g, _, ranks in got for r in ranks):
        hint = " — a rank reported in a group it does not belong to: compare only within each replica group"
    elif want and not got:
        hint = " — nothing found: compare the digests within each group, name by name"
    pytest.fail(f"odd_replicas, case {case!r}: got {got}, expected {want}{hint}", pytrace=False)


# ------------------------------------------------------------------------------------------------------------------
# check_manifest


def _checkpoint(tmp_path, world: int = 3) -> tuple:
    directory = tmp_path / "step_00000010"
    directory.mkdir()
    files = {}
    for rank in range(world):
        data = bytes((rank * 7 + i) % 256 for i in range(3000 + 100 * rank))
        (directory / f"rank{rank}.pt").write_bytes(data)
        files[f"rank{rank}.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta = {"format": 1, "step": 10, "world_size": world, "files": files}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory, meta


def _damage(directory, meta, case: str, tmp_path) -> str:
    """Damage the checkpoint as `case` says; return what the error must name."""
    meta_path = directory / "meta.json"
    if case == "missing file":
        (directory / "rank1.pt").unlink()
        return "rank1.pt"
    if case == "truncated file":
        data = (directory / "rank2.pt").read_bytes()
        (directory / "rank2.pt").write_bytes(data[:1000])
        return "rank2.pt"
    if case == "one bit flipped (same size)":
        data = bytearray((directory / "rank0.pt").read_bytes())
        data[1500] ^= 0x10
        (directory / "rank0.pt").write_bytes(bytes(data))
        return "rank0.pt"
    if case == "meta.json lists fewer files than world_size":
        del meta["files"]["rank2.pt"]
    if case == "a name that leaves the directory":
        (tmp_path / "secret").write_bytes(b"x")
        meta["files"]["../secret"] = meta["files"].pop("rank1.pt")
        meta_path.write_text(json.dumps(meta))
        return "../secret"
    if case == "meta.json missing":
        meta_path.unlink()
        return "meta.json"
    meta_path.write_text(json.dumps(meta))
    return "meta.json"


MANIFEST_CAUSES = {
    "missing file": "check that each recorded file exists",
    "truncated file": "compare each file's size with meta.json's",
    "one bit flipped (same size)": "a size check alone misses it: compare the SHA-256 too",
    "meta.json lists fewer files than world_size": "a rank's file missing from the manifest: compare the number of "
                                                   "files with world_size",
    "a name that leaves the directory": "meta.json is untrusted input: accept only plain names inside the directory",
    "meta.json missing": "no manifest, no check: refuse",
}


@pytest.mark.parametrize("case", ["intact", *MANIFEST_CAUSES])
def test_ch13_check_manifest(impl: str, tmp_path, case: str) -> None:
    check_manifest = load(impl, MODULE, "check_manifest")
    directory, meta = _checkpoint(tmp_path)
    if case == "intact":
        got = check_manifest(directory)
        assert list(got) == ["rank0.pt", "rank1.pt", "rank2.pt"], \
            f"check_manifest, case 'intact': got {got}, expected the three rank files, sorted"
        return
    named = _damage(directory, meta, case, tmp_path)
    refused = _refusal(check_manifest, directory)
    if refused is None:
        pytest.fail(f"check_manifest, case {case!r}: accepted the checkpoint — {MANIFEST_CAUSES[case]}", pytrace=False)
    assert named in refused and "\n" not in refused, (
        f"check_manifest, case {case!r}: refuse in one line naming {named!r}, got {refused!r}")
