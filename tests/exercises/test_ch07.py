"""Grade chapter 07's exercises: bucketed, overlapped gradient averaging with accumulation, and ZeRO's owned pieces.

`pytest tests/exercises -k ch07` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
The oracles: one process's gradient of the whole global batch (data parallelism must reproduce it), the bucket
layout of `minidist.parallel.dp.data_parallel.assign_buckets`, and the flat layout of its `Bucket` (padding and
`shard_range`) for ZeRO's pieces.
"""

import importlib
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from grading import load
from torch import nn

from minidist.comm.launch import run_ranks
from minidist.model import build_model, get_preset, lm_loss
from minidist.parallel.dp.data_parallel import Bucket, assign_buckets

MODULE = "ch07_data_parallel"
# A model small enough to train in milliseconds, with 21 parameter tensors of 32 to 2048 elements.
CFG = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=16)
GLOBAL_BATCH, SEQ, STEPS = 12, 16, 2
BUCKET_BYTES = (8 * 1024, 2**30)  # several buckets; one bucket for everything
MICROBATCHES = (1, 2)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, CFG["vocab_size"], (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _reference(cfg, step: int) -> dict[str, torch.Tensor]:
    """One process, the whole global batch: the gradient every data-parallel rank must end up with."""
    model = build_model(cfg, seed=0)
    x, y = _batch(step)
    lm_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@contextmanager
def _recording_all_reduce(log: list):
    """Record every dist.all_reduce call (elements, dtype, async_op) in `log` and run it."""
    original = dist.all_reduce

    def call(tensor, *args, **kwargs):
        log.append(("all_reduce", tensor.numel(), tensor.dtype, bool(kwargs.get("async_op", False))))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = call
    try:
        yield
    finally:
        dist.all_reduce = original


def _run_case(fn, cfg, bucket_bytes: int, microbatches: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(cfg, seed=0)
    names = {p: n for n, p in model.named_parameters()}
    log: list = []
    # Registered before the answer's hooks, so each runs first: "grad" marks when backward produced a gradient.
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: log.append(("grad", names[p])))
    rows = GLOBAL_BATCH // world
    steps = []
    with _recording_all_reduce(log):
        finish = fn(model, bucket_bytes, microbatches)
        for step in range(STEPS):
            log.clear()
            x, y = _batch(step)
            mine_x, mine_y = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
            for mx, my in zip(mine_x.chunk(microbatches), mine_y.chunk(microbatches)):
                (lm_loss(model(mx), my) / microbatches).backward()
                log.append(("backward_end",))
            finish()
            grads = {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in model.named_parameters()}
            steps.append({"log": list(log), "grads": grads})
            model.zero_grad(set_to_none=True)
    return {"bucket_bytes": bucket_bytes, "microbatches": microbatches, "steps": steps}


def grade_worker(impl: str) -> dict | None:
    """On every rank: run the answer on every case; None when it is not implemented (on every rank alike)."""
    torch.manual_seed(0)
    cfg = get_preset("tiny", **CFG)
    fn = importlib.import_module(f"{impl}.{MODULE}").bucketed_all_reduce
    try:
        cases = [_run_case(fn, cfg, b, m) for b in BUCKET_BYTES for m in MICROBATCHES]
    except NotImplementedError:
        return None
    return {"cases": cases, "reference": [_reference(cfg, step) for step in range(STEPS)]}


@pytest.fixture(scope="module", params=[2, 3], ids=lambda p: f"world{p}")
def graded(request: pytest.FixtureRequest, impl: str) -> tuple[int, list]:
    world = request.param
    case = (f"world {world}: {impl}.{MODULE}.bucketed_all_reduce on the tiny model, bucket_bytes {BUCKET_BYTES}, "
            f"micro-batches {MICROBATCHES}, {STEPS} steps of {GLOBAL_BATCH} x {SEQ} tokens")
    return world, run_ranks(grade_worker, world, impl, timeout=90, case=case)


def _not_implemented(per_rank: list, impl: str) -> None:
    if any(r is None for r in per_rank):
        pytest.fail(f"{impl}.{MODULE}.bucketed_all_reduce is not implemented yet", pytrace=False)


def _gradient_hint(got: dict, want: dict, world: int, microbatches: int, step: int) -> str:
    flat_got = torch.cat([got[n].flatten() for n in want]).double()
    flat_want = torch.cat([want[n].flatten() for n in want]).double()
    if not flat_got.any():
        return (" — every gradient is zero: if .grad is a view of a bucket, zeroing the bucket afterwards zeroes it "
                "too (write a copy, or zero at the start of the next step)")
    ratio = (flat_got @ flat_want / (flat_want @ flat_want)).item()
    if abs(ratio - world) < 0.01 * world:
        return f" — about {world}x too large: the all-reduce sums, divide by the world size"
    if abs(ratio - 1 / world) < 0.01 / world:
        return " — about world_size times too small: did you divide twice?"
    if step > 0:
        return " — the first step was right: finish() must zero the buckets and reset the counters for the next step"
    if microbatches > 1:
        return (" — with several micro-batches: add each backward's gradient into the bucket once and set "
                "param.grad = None (else .grad keeps the earlier micro-batches and you add them again), and launch "
                "only after the last backward")
    return ""


def test_ch07_bucketed_all_reduce_gradients(graded: tuple[int, list], impl: str) -> None:
    world, per_rank = graded
    _not_implemented(per_rank, impl)
    for rank, out in enumerate(per_rank):
        for case in out["cases"]:
            for step, result in enumerate(case["steps"]):
                want = out["reference"][step]
                where = (f"world {world}, rank {rank}, bucket_bytes {case['bucket_bytes']}, "
                         f"{case['microbatches']} micro-batch(es), step {step}")
                missing = [n for n, g in result["grads"].items() if g is None]
                assert not missing, f"{where}: after finish(), {missing[:3]} have no .grad; write the average there"
                for name, g in want.items():
                    got = result["grads"][name]
                    assert got.shape == g.shape, \
                        f"{where}: {name}.grad has shape {tuple(got.shape)}, want {tuple(g.shape)}"
                    if not torch.allclose(got, g, rtol=1e-4, atol=1e-6):
                        hint = _gradient_hint(result["grads"], want, world, case["microbatches"], step)
                        pytest.fail(f"{where}: {name}.grad differs from one process's gradient of the whole batch by "
                                    f"up to {(got - g).abs().max().item():.2e}{hint}", pytrace=False)


def test_ch07_bucketed_all_reduce_collectives(graded: tuple[int, list], impl: str) -> None:
    world, per_rank = graded
    _not_implemented(per_rank, impl)
    cfg = get_preset("tiny", **CFG)
    named = list(build_model(cfg, seed=0).named_parameters())
    for rank, out in enumerate(per_rank):
        for case in out["cases"]:
            want = [b.numel for b in assign_buckets(named, case["bucket_bytes"])]
            for step, result in enumerate(case["steps"]):
                where = (f"world {world}, rank {rank}, bucket_bytes {case['bucket_bytes']}, "
                         f"{case['microbatches']} micro-batch(es), step {step}")
                log = result["log"]
                calls = [e for e in log if e[0] == "all_reduce"]
                sizes = [e[1] for e in calls]
                assert len(calls) == len(want), (
                    f"{where}: {len(calls)} all-reduces in the step, expected one per bucket ({len(want)})"
                    + (" — communicate only during the last micro-batch's backward" if len(calls) > len(want) else ""))
                assert sizes == want, (f"{where}: all-reduce sizes {sizes}, expected the buckets of assign_buckets "
                                       f"in index order {want} (reversed parameters, new bucket when the fp32 bytes "
                                       "would exceed bucket_bytes; launch strictly in index order)")
                assert all(e[2] == torch.float32 for e in calls), f"{where}: buckets must be fp32"
                assert all(e[3] for e in calls), f"{where}: launch with async_op=True (keep the work, wait in finish)"
                last_backward = max(i for i, e in enumerate(log) if e[0] == "backward_end")
                assert all(i < last_backward for i, e in enumerate(log) if e[0] == "all_reduce"), (
                    f"{where}: an all-reduce was launched after backward ended: launch each bucket from the hook that "
                    "completes it, not in finish()")
                if len(want) > 1:
                    last_grad = max(i for i, e in enumerate(log) if e[0] == "grad")
                    first_call = min(i for i, e in enumerate(log) if e[0] == "all_reduce")
                    assert first_call < last_grad, (
                        f"{where}: the first all-reduce started only after every gradient existed, so nothing "
                        "overlaps with backward — launch a bucket as soon as its last gradient of the step arrives")


# ------------------------------------------------------------------------------------------------------------------
# ZeRO's owned pieces

PIECE_CASES = [([5, 3, 8], 4), ([7, 1, 13], 4), ([3], 8), ([1000, 1, 1, 17, 250], 3), ([64, 64], 1), ([2, 9, 4], 5)]


def _layout(numels: list[int], world: int) -> Bucket:
    params = [(f"p{i}", nn.Parameter(torch.empty(n))) for i, n in enumerate(numels)]
    return Bucket(0, params, pad_to=world)


@pytest.mark.parametrize("numels, world", PIECE_CASES, ids=[f"{n}-world{w}" for n, w in PIECE_CASES])
def test_ch07_zero_owned_pieces(impl: str, numels: list[int], world: int) -> None:
    zero_owned_pieces = load(impl, MODULE, "zero_owned_pieces")
    bucket = _layout(numels, world)
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(n, generator=g, dtype=torch.float64) for n in numels]
    flat = torch.zeros(bucket.padded, dtype=torch.float64)
    for v, offset in zip(values, bucket.offsets):
        flat[offset:offset + v.numel()] = v
    covered = [torch.zeros(n, dtype=torch.int64) for n in numels]
    for rank in range(world):
        where = f"zero_owned_pieces({numels}, world={world}, rank={rank})"
        pieces = zero_owned_pieces(list(numels), world, rank)
        start, stop = bucket.shard_range(rank, world)
        owned = flat[start:stop]
        shard = torch.zeros(stop - start, dtype=torch.float64)
        filled = torch.zeros(stop - start, dtype=torch.bool)
        assert isinstance(pieces, list), f"{where}: return a list of (i, start, stop, shard_offset) tuples"
        for piece in pieces:
            assert len(piece) == 4, f"{where}: {piece} is not (i, start, stop, shard_offset)"
            i, a, b, o = (int(x) for x in piece)
            assert 0 <= i < len(numels), f"{where}: piece {piece} names parameter {i}; there are {len(numels)}"
            assert 0 <= a < b <= numels[i], \
                f"{where}: piece {piece} is not a non-empty range of parameter {i} (numel {numels[i]})"
            assert 0 <= o and o + b - a <= stop - start, (
                f"{where}: piece {piece} falls outside the rank's shard of {stop - start} elements "
                f"(padded {bucket.padded} / world {world})")
            shard[o:o + b - a] = values[i][a:b]
            assert not filled[o:o + b - a].any(), f"{where}: piece {piece} overlaps another piece in the shard"
            filled[o:o + b - a] = True
            covered[i][a:b] += 1
        assert [int(p[0]) for p in pieces] == sorted(int(p[0]) for p in pieces), f"{where}: pieces out of order"
        real = torch.arange(start, stop) < sum(numels)  # the elements that are not padding
        assert torch.equal(filled, real), (
            f"{where}: the pieces fill shard positions {filled.nonzero().flatten().tolist()[:8]}..., but the rank "
            f"owns flat [{start}, {stop}) of which [{start}, {min(stop, sum(numels))}) are parameters — "
            "padded = the next multiple of world, S = padded / world, rank r owns [r·S, (r+1)·S)")
        assert torch.equal(shard[real], owned[real]), (
            f"{where}: the pieces pick the wrong elements: the shard they describe differs from flat[{start}:{stop}] "
            "(start/stop count inside the parameter, shard_offset inside the rank's shard)")
    for i, c in enumerate(covered):
        assert torch.equal(c, torch.ones_like(c)), (
            f"zero_owned_pieces({numels}, world={world}): over all ranks, parameter {i}'s elements are owned "
            f"{sorted(set(c.tolist()))} times; every element must belong to exactly one rank")
