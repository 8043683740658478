"""Grade chapter 13's exercises: naming the first differing replica tensor, and a checksum-verified read.

`pytest tests/exercises -k ch13` grades solutions/ (the default); add `--impl exercises` to grade your own answers
(`make grade CH=13`). The oracles are tables built here with a known difference, and a real file damaged here.
"""

import hashlib

import pytest
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
    for what, content in (("one bit flipped", bytes(damaged)), ("truncated", data[:100])):
        path.write_bytes(content)
        with pytest.raises(ValueError) as info:
            verified_bytes(path, len(data), digest)
        assert str(path) in str(info.value) and "\n" not in str(info.value), (
            f"verified_bytes: a {what} file must be refused in one line naming it, got {info.value}")
    path.unlink()
    with pytest.raises(ValueError, match="missing"):
        verified_bytes(path, len(data), digest)
