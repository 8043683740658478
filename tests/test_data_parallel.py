"""Chapter 07, data parallelism: parity with one device, teeth, ledger bytes, overlap, fp32 reduction, batch split.

Every multi-process case runs inside one launch per world size (tests/dp_cases.py); these tests read its results.
"""

from __future__ import annotations

import dp_cases
import parity
import pytest
import torch

from minidist.comm.communicator import Comm
from minidist.model import build_model, lm_loss
from minidist.parallel import DataParallel, assign_buckets, check_batch_split, split_batch

WORLDS = (2, 4)

DP_CASES = ["naive_m1", "naive_m2", "bucketed_m1", "bucketed_m2", "overlap_m1", "overlap_m2"]


def mean_losses(world: int, case: str) -> list[float]:
    """The global batch's mean loss per step: every rank's micro-batches have equal size, so average the ranks."""
    per_rank = [r[case]["losses"] for r in dp_cases.results(world)]
    return [sum(step) / world for step in zip(*per_rank)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", DP_CASES)
def test_parity_with_one_device(world: int, case: str) -> None:
    reference = parity.reference_run()
    parity.assert_losses_match(mean_losses(world, case), reference["losses"], f"dp={world} {case}")
    parity.assert_grads_match(dp_cases.results(world)[0][case]["grads"], reference["grads"], f"dp={world} {case}")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", DP_CASES)
def test_replicas_stay_identical(world: int, case: str) -> None:
    hashes = {r[case]["replica_hash"] for r in dp_cases.results(world)}
    assert len(hashes) == 1, f"dp={world} {case}: replicas hold different parameters after training: {hashes}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ["broken_skip_sync", "broken_no_scale_m2"])
def test_parity_check_has_teeth(world: int, case: str) -> None:
    """A missing all-reduce, or gradient accumulation without 1/M, must fail the very check the real code passes."""
    reference = parity.reference_run()
    with pytest.raises(AssertionError, match="gradient differs"):
        parity.assert_grads_match(dp_cases.results(world)[0][case]["grads"], reference["grads"], case)


@pytest.mark.parametrize("world", WORLDS)
def test_skipping_the_sync_lets_replicas_drift(world: int) -> None:
    hashes = {r["broken_skip_sync"]["replica_hash"] for r in dp_cases.results(world)}
    assert len(hashes) == world


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", DP_CASES)
def test_ledger_bytes_per_step(world: int, case: str) -> None:
    """Ring all-reduce sends 2(N-1)/N·M bytes per rank, once per optimizer step whatever the micro-batch count."""
    results = dp_cases.results(world)
    n_params = len(list(build_model(parity.CFG).parameters()))
    for rank, r in enumerate(results):
        out = r[case]
        elements = out.get("padded", out["numel"])  # buckets are padded to a multiple of N (< N zeros each)
        assert 0 <= elements - out["numel"] < world * out.get("buckets", 1)
        for step, entry in enumerate(out["ledger"][1:], start=1):  # step 0 also gathers gradients for the test
            assert set(entry) == {("all_reduce", "dp_cp")}, f"{case} rank {rank} step {step}: {entry}"
            got = entry[("all_reduce", "dp_cp")]
            assert got["bytes"] == 2 * (world - 1) * elements * 4 // world, f"{case} rank {rank} step {step}"
            calls = n_params if case.startswith("naive") else out["buckets"]
            assert got["calls"] == calls, f"{case}: {got['calls']} all-reduces per step, want {calls}"


@pytest.mark.parametrize("world", WORLDS)
def test_overlap_launches_during_backward(world: int) -> None:
    """Overlapped: the first bucket's all-reduce starts before backward ends. Bucketed: every one starts after."""
    def first(events, kind):
        return min(t for k, t, _ in events if k == kind)

    for r in dp_cases.results(world):
        overlapped = r["overlap_m1"]["timeline"]
        launches = [t for k, t, _ in overlapped if k == "launch"]
        assert min(launches) < first(overlapped, "backward_end")
        assert sum(t < first(overlapped, "backward_end") for t in launches) >= len(launches) - 1
        assert first(overlapped, "wait_end") >= max(t for k, t, _ in overlapped if k == "done")
        bucketed = r["bucketed_m1"]["timeline"]
        assert min(t for k, t, _ in bucketed if k == "launch") > first(bucketed, "backward_end")


def test_bf16_gradients_reduce_in_fp32() -> None:
    """bf16 parameters, 2 micro-batches, 2 ranks: the fp32 buckets hold the exact average to fp32 precision."""
    out = dp_cases.results(2)[0]["bf16"]
    assert out["dtypes"] == {"torch.bfloat16", "torch.float32"}  # p.grad in the model's dtype, main_grad in fp32
    assert out["err_fp32"] <= 1e-6 * out["scale"], out
    # A bf16 bucket (rounding every partial sum) is far off; the test would notice the difference.
    assert out["err_bf16"] > 100 * out["err_fp32"], out


def test_batch_split_errors_are_one_line() -> None:
    assert check_batch_split(8, 2, 2) == 2
    with pytest.raises(ValueError, match=r"^global batch 6 does not split into dp=4 ranks x 1 micro-batches; "
                                         r"use a multiple of 4$"):
        check_batch_split(6, 4)
    with pytest.raises(ValueError, match="multiple of 6"):
        split_batch(torch.zeros(8, 4), torch.zeros(8, 4), 0, 3, 2)


def test_split_batch_takes_contiguous_rows() -> None:
    inputs = torch.arange(16).view(8, 2)
    pieces = split_batch(inputs, inputs + 100, rank=1, dp=2, microbatches=2)
    assert [p[0].tolist() for p in pieces] == [inputs[4:6].tolist(), inputs[6:8].tolist()]
    assert torch.equal(pieces[1][1], inputs[6:8] + 100)


def test_buckets_respect_the_cap_and_reverse_order() -> None:
    model = build_model(parity.CFG)
    named = list(model.named_parameters())
    buckets = assign_buckets(named, bucket_bytes=64 * 1024, pad_to=4)
    assert [n for b in buckets for n in b.names] == [n for n, _ in reversed(named)]
    for b in buckets:
        assert b.numel * 4 <= 64 * 1024 or len(b.params) == 1
        assert b.padded % 4 == 0 and 0 <= b.padded - b.numel < 4


def test_single_rank_data_parallel_is_plain_training(one_thread) -> None:
    """World size 1 (no process group): DataParallel is the identity on gradients, accumulation included."""
    model, twin = build_model(parity.CFG, seed=3), build_model(parity.CFG, seed=3)
    dp = DataParallel(model, Comm(), bucket_bytes=32 * 1024)
    inputs, targets = parity.global_batch(0)
    for i, (x, y) in enumerate(split_batch(inputs, targets, 0, 1, 2)):
        if i == 0:
            with dp.no_sync():
                (lm_loss(model(x), y) / 2).backward()
        else:
            (lm_loss(model(x), y) / 2).backward()
        (lm_loss(twin(x), y) / 2).backward()
    dp.finish_grad_sync()
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-8, msg=name)


def test_bucket_cap_defaults_by_device_and_is_a_setting(tmp_path) -> None:
    from minidist.parallel import ZeroOptimizer
    from minidist.parallel.dp.data_parallel import default_bucket_bytes
    from minidist.train.config import ConfigError, parse_config
    from minidist.train.preflight import resolve_layout

    # DDP's 25 MiB on CUDA (few NCCL calls); a CPU keeps the 4 MiB of chapter 07's figures.
    assert default_bucket_bytes(torch.device("cuda", 1)) == 25 * 2**20
    assert default_bucket_bytes(torch.device("cpu")) == 4 * 2**20
    # A CPU model given no cap is bucketed at 4 MiB: the small preset needs several buckets, each under the cap.
    model = build_model(parity.CFG.replace(d_model=256, d_ff=1024, n_layers=4))
    buckets = DataParallel(model, Comm()).buckets
    assert [b.names for b in buckets] == [b.names for b in assign_buckets(list(model.named_parameters()), 4 * 2**20)]
    assert len(buckets) > 1 and all(b.numel * 4 <= 4 * 2**20 or len(b.params) == 1 for b in buckets)
    zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters()), Comm(), 1, bucket_bytes=2**20)
    assert all(b.numel * 4 <= 2**20 or len(b.params) == 1 for b in zero.buckets) and len(zero.buckets) > len(buckets)
    # --bucket-mb: MiB, through the layout to the engines; a cap under one byte is refused in one line.
    cfg = parse_config(["--bucket-mb", "0.5", "--out", str(tmp_path)])
    assert resolve_layout(cfg, 1).options.bucket_bytes == 2**19
    assert resolve_layout(parse_config(["--out", str(tmp_path)]), 1).options.bucket_bytes is None
    with pytest.raises(ConfigError, match="bucket_mb must be > 0"):
        parse_config(["--bucket-mb", "0"])
