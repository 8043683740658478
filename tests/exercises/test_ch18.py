"""Grade chapter 18's exercises: a Placement as DTensor placements, a redistribute's collective and bytes, a minidist
state in torchtitan's names and RoPE layout.

`pytest tests/exercises -k ch18` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
The oracles are the package's own versions (`minidist.native.placements`, `minidist.convert.titan_model`), which
tests/test_native.py holds against DTensor on real ranks, the ledger and torchtitan's Llama 3.
"""

import dataclasses

import pytest
import torch
from grading import load

from minidist.convert import titan_model
from minidist.model import build_model, get_preset
from minidist.model.rope import interleaved_to_half_permutation
from minidist.native import placements as native
from minidist.parallel.placement import Placement, Split

MODULE = "ch18_pytorch_native"
pytestmark = pytest.mark.usefixtures("one_thread")

GRID = ("pp", "dp", "cp", "tp")
# name -> (Placement, mesh dims): what parallelize attaches to a 4-D grid's parameters
CASES = {
    "column-parallel wq (tp4)": (Placement((64, 64), {"tp": Split(0, 1, 4, 1)}, 0, ("dp_cp",)), GRID),
    "row-parallel wo (tp2)": (Placement((64, 64), {"tp": Split(1, 1, 2, 1)}, 0, ("dp_cp",)), GRID),
    "norm, whole on every tp rank": (Placement((64,), {"tp": Split(None, 0, 1, 2)}, 0, ("dp_cp",)), GRID),
    "embedding, tp × dp mesh": (Placement((256, 64), {"tp": Split(0, 0, 2, 1)}, 0, ("dp_cp",)), ("dp", "tp")),
    "replicated over dp only": (Placement((8, 8), {}, 0, ("dp",)), ("dp", "cp")),
}


def _names(placements) -> list[str]:
    return [repr(p) for p in placements]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("grad", [False, True], ids=["param", "grad"])
def test_ch18_dtensor_placements(impl: str, case: str, grad: bool) -> None:
    dtensor_placements = load(impl, MODULE, "dtensor_placements")
    placement, dims = CASES[case]
    got, want = dtensor_placements(placement, dims, grad), native.dtensor_placements(placement, dims, grad)
    where = f"dtensor_placements({case}, mesh {dims}, grad={grad})"
    assert isinstance(got, tuple) and len(got) == len(dims), f"{where}: want a tuple of {len(dims)} placements, " \
                                                               f"one per mesh dimension, got {got!r}"
    if _names(got) == _names(want):
        return
    hint = ""
    split = placement.splits.get("tp")
    if split is not None and split.dim is not None and any(
            getattr(p, "dim", None) == 1 - split.dim for p in got if p.is_shard()):
        hint = " — the Split's dim is the tensor dim that is cut: a column-parallel weight [out, in] is cut along " \
               "dim 0 (its output rows), a row-parallel one along dim 1"
    elif grad and any(p.is_replicate() for p in got) and any(p.is_partial() for p in want):
        hint = " — a gradient is still a per-rank summand over the dimensions its parameter is replicated on: Partial"
    elif not grad and any(p.is_partial() for p in got):
        hint = " — a parameter itself is never Partial: its replicas hold equal values (Replicate)"
    elif "dp_cp" in placement.replicated_over and grad:
        hint = " — \"dp_cp\" is the dp and cp dimensions together: Partial on both"
    elif split is not None and split.dim is None and any(p.is_shard() for p in got):
        hint = " — dim None means the whole tensor on every rank of the group: Replicate"
    pytest.fail(f"{where} = {_names(got)}, expected {_names(want)}{hint}", pytrace=False)


def test_ch18_dtensor_placements_refuses_a_shared_slice(impl: str) -> None:
    dtensor_placements = load(impl, MODULE, "dtensor_placements")
    kv = Placement((32, 64), {"tp": Split(0, 0, 2, 2)}, 0, ())  # 2 kv heads over tp 4: each slice on 2 ranks
    try:
        got = dtensor_placements(kv, ("tp",))
    except ValueError:
        return
    pytest.fail(f"a kv weight sliced in 2 and held by 2 ranks each over tp 4 has no DTensor placement (Shard(0) on "
                f"4 ranks would mean 4 distinct slices); raise ValueError — got {_names(got)}", pytrace=False)


MOVES = [("S0", "R"), ("P", "R"), ("P", "S0"), ("S0", "S1"), ("R", "S0"), ("S1", "R"), ("R", "R")]


def _dtensor(code: str):
    from torch.distributed.tensor import Partial, Replicate, Shard

    return {"R": Replicate(), "P": Partial()}[code] if code in ("R", "P") else Shard(int(code[1]))


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("move", MOVES, ids=[f"{a}->{b}" for a, b in MOVES])
def test_ch18_redistribute_cost(impl: str, move: tuple[str, str], p: int) -> None:
    redistribute_cost = load(impl, MODULE, "redistribute_cost")
    src, dst = move
    shape, size = (16, 24), 4
    want = native.redistribute_bytes(_dtensor(src), _dtensor(dst), shape, size, p, 0, "cuda")
    got = redistribute_cost(src, dst, shape, size, p)
    where = f"redistribute_cost({src!r} -> {dst!r}, full shape {shape} fp32, p={p})"
    assert isinstance(got, tuple) and len(got) == 2, f"{where}: return (collective, bytes), got {got!r}"
    if tuple(got) == tuple(want):
        return
    full = 16 * 24 * size
    hints = {full * (p - 1) // p: "(p − 1)/p of the full tensor: an all-gather's or reduce-scatter's bytes",
             full: "the whole tensor: a ring sends (p − 1)/p of it, not all of it",
             2 * full * (p - 1) // p: "2(p − 1)/p of the full tensor: an all-reduce's",
             full // p * (p - 1) // p: "(p − 1)/p of the local shard: an all-to-all's"}
    hint = ""
    if got[0] != want[0]:
        hint = f" — {src} -> {dst} is {want[0] or 'no collective at all'}"
        if want[0] is None and src == "R":
            hint += " (Replicate -> Shard: every rank already holds its slice)"
    elif want[0] == "all_to_all" and got[1] == full * (p - 1) // p:
        hint = " — an all-to-all moves pieces of the local shard (M/p bytes), not of the full tensor"
    elif got[1] in hints:
        hint = f" — {got[1]:,} bytes is {hints[got[1]]}"
    pytest.fail(f"{where} = {got}, expected {want}{hint}", pytrace=False)


CFG = get_preset("tiny", d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=32)
ROTATED = ("wq.weight", "wk.weight")


def _per_head(w: torch.Tensor, head_dim: int, index: torch.Tensor) -> torch.Tensor:
    return w.reshape(-1, head_dim, w.shape[-1])[:, index].reshape(w.shape)


def _titan_hint(got: torch.Tensor, source: torch.Tensor, name: str, layout: str, head_dim: int) -> str:
    """The likely cause of a wrong tensor under torchtitan's `name`."""
    p = interleaved_to_half_permutation(head_dim)
    if not name.endswith(ROTATED):
        return " — only W_q and W_k are rotated; leave the other weights as they are"
    if layout == "interleaved":
        return " — an interleaved model is already in torchtitan's layout: no permutation"
    if torch.equal(got, source):
        return " — the q/k rows must be permuted from the half layout to the interleaved one"
    if torch.equal(got, _per_head(source, head_dim, p)):
        return " — that is x[p], the interleaved -> half direction; half -> interleaved is x[argsort(p)]"
    if torch.equal(got, source[torch.argsort(interleaved_to_half_permutation(source.shape[0]))]):
        return " — the permutation acts within each head (blocks of head_dim rows), not across all the rows"
    return " — permute each head's block of head_dim rows by argsort(p)"


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_ch18_to_titan_state(impl: str, layout: str) -> None:
    to_titan_state = load(impl, MODULE, "to_titan_state")
    cfg = dataclasses.replace(CFG, rope_layout=layout)
    state = {k: v.detach() for k, v in build_model(cfg, seed=0).named_parameters()}
    before = {k: v.clone() for k, v in state.items()}
    got = to_titan_state(state, cfg.head_dim, layout)
    want = titan_model.to_titan(cfg, state)
    where = f"to_titan_state(a {cfg.n_layers}-layer {layout}-layout model)"
    assert all(torch.equal(state[k], before[k]) for k in state), f"{where} changed its input"
    if sorted(got) != sorted(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        hint = " — torchtitan 0.3.0 keeps q, k, v under attention.qkv_linear" if any(
            ".attention.w" in k and "wo" not in k for k in extra) else ""
        pytest.fail(f"{where}: names differ: missing {missing[:3]}, unexpected {extra[:3]}{hint}", pytrace=False)
    for name, value in want.items():
        if not torch.equal(got[name], value):
            source = state[titan_model.minidist_name(name)]
            pytest.fail(f"{where}: {name} differs from the expected tensor"
                        f"{_titan_hint(got[name], source, name, layout, cfg.head_dim)}", pytrace=False)
