"""MFU that cannot lie: the causal attention count, datasheet peaks, a measured peak over several shapes for at least
a second, a peak raised to any achieved rate (MFU <= 1 in every metrics row), the cumulative figure."""

import json
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from minidist import flops, hardware
from minidist.model import get_preset
from minidist.train import loop as train
from tests.test_train import small_config


def test_causal_count_is_the_hand_formula():
    cfg = get_preset("llama3-8b")
    L, H, Q, T = cfg.n_layers, cfg.n_heads, cfg.head_dim, 8192
    # Query i meets i+1 keys: Σ_i (i+1) = T(T+1)/2 pairs; each pair costs 2·Q (score) + 2·Q (value) forward, ×3.
    per_token = L * H * 3 * (2 * Q + 2 * Q) * (T * (T + 1) / 2) / T
    assert flops.causal_attention_flops_per_token(cfg, T) == pytest.approx(per_token, rel=1e-12)
    # A little more than half of PaLM's full count, and MFU's count is 6N + that.
    full = flops.attention_flops_per_token(cfg, T)
    assert 0.5 * full < flops.causal_attention_flops_per_token(cfg, T) < 0.501 * full
    assert flops.mfu_flops_per_token(cfg, T) == pytest.approx(
        flops.flops_per_token(cfg, T) - full + per_token, rel=1e-12)


def test_causal_count_equals_a_masked_matmul_count():
    """Attention computed row by row over the unmasked keys only, forward and backward, under FlopCounterMode:
    what a kernel that skips every masked entry does."""
    cfg = get_preset("tiny", n_layers=1)
    H, Q, T = cfg.n_heads, cfg.head_dim, 12
    q, k, v = (torch.randn(H, T, Q, requires_grad=True) for _ in range(3))
    with FlopCounterMode(display=False) as counter:
        rows = []
        for i in range(T):
            scores = q[:, i:i + 1] @ k[:, :i + 1].transpose(1, 2)  # [H, 1, i+1]: only the keys query i may see
            rows.append(torch.softmax(scores, -1) @ v[:, :i + 1])
        torch.cat(rows, 1).sum().backward()
    assert counter.get_total_flops() / T == flops.causal_attention_flops_per_token(cfg, T)
    assert counter.get_total_flops() / T < flops.attention_flops_per_token(cfg, T)  # PaLM's full count is more


def test_datasheet_peaks_and_device_names():
    table = {chip.name: hardware.peak_flops(chip.name) for chip in hardware.CHIPS}
    assert table["H100-NVL"] == table["H200-NVL"] == 835e12 < table["H100-SXM"] == table["H200-SXM"]
    assert table["H100-PCIe"] < table["H100-NVL"] and table["B200"] > 2 * table["H100-SXM"]
    names = {"NVIDIA H100 80GB HBM3": "H100-SXM", "NVIDIA H100 PCIe": "H100-PCIe", "NVIDIA H100 NVL": "H100-NVL",
             "NVIDIA H200": "H200-SXM", "NVIDIA H200 NVL": "H200-NVL", "NVIDIA A100-SXM4-80GB": "A100",
             "NVIDIA H800": "H800", "NVIDIA B200": "B200", "NVIDIA GeForce RTX 4090": None}
    assert {name: hardware.datasheet_chip(name) for name in names} == names


def test_measured_peak_takes_at_least_the_time_asked_over_all_shapes():
    shapes = [(64, 64, 64), (128, 256, 64)] + flops.model_matmul_shapes(get_preset("tiny"), 256)
    start = time.perf_counter()
    best, shape = flops.measure_matmul_peak(shapes, min_seconds=0.3)
    assert time.perf_counter() - start >= 0.3
    assert shape in shapes and 1e6 < best < 100e12
    assert (256, 128, 384) in flops.model_matmul_shapes(get_preset("tiny"), 256)  # tokens x d_model -> d_ff
    with pytest.raises(ValueError, match="min_seconds"):
        flops.measure_matmul_peak(shapes, min_seconds=0)


def test_override_wins_and_the_meter_never_passes_one():
    cfg = get_preset("tiny")
    assert flops.peak_for_device(torch.device("cpu"), "fp32", 5e9, cfg, 64) == (5e9, "set by --peak-flops")
    meter = flops.MfuMeter(flops_per_token=1e6, peak_flops=1e9)
    assert meter.step(100, 1.0, count=False) == (pytest.approx(0.1), None)  # 1e8 of 1e9
    mfu, note = meter.step(3000, 1.0)  # 3e9 > 1e9: the peak becomes 3e9
    assert mfu == 1.0 and "raised" in note and meter.peak == 3e9 and meter.raised_from == 1e9
    mfu, note = meter.step(6000, 1.0)  # beaten again: raised again, said only once
    assert mfu == 1.0 and note is None and meter.peak == 6e9
    meter.step(3000, 1.0)
    assert meter.cumulative == pytest.approx((9000 + 3000) * 1e6 / (3.0 * 6e9))  # the uncounted step left out


def test_a_datasheet_peak_is_never_raised():
    # A step above a GPU's datasheet peak is a timing bug (a clock stopped before the device finished): said once,
    # and the MFU reported as measured, not hidden under a raised peak.
    meter = flops.MfuMeter(flops_per_token=1e6, peak_flops=1e9, datasheet=True)
    mfu, note = meter.step(3000, 1.0)
    assert mfu == pytest.approx(3.0) and "timing bug" in note and meter.peak == 1e9 and meter.raised_from is None
    mfu, note = meter.step(6000, 1.0)
    assert mfu == pytest.approx(6.0) and note is None and meter.peak == 1e9


def test_every_metrics_row_is_at_most_one_when_the_peak_was_measured_low(tmp_path, monkeypatch, capsys):
    # A peak measured while the machine was busy: far below what the steps then achieve.
    monkeypatch.setattr(flops, "measure_matmul_peak", lambda shapes, dtype, device, min_seconds: (1e6, shapes[0]))
    summary = train.train(small_config(tmp_path, peak_flops=None, steps=4))
    out = tmp_path / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(0 < r["mfu"] <= 1 for r in rows)
    assert all(len(r["peak_mem_bytes"]) == 1 and r["peak_mem_bytes"][0] > 0 for r in rows)
    info = json.loads((out / "run.json").read_text())
    assert info["peak_flops"] == 1e6 and info["peak_flops_source"].startswith("measured cpu fp32")
    assert "causal" in info["mfu_convention"] and info["mfu_flops_per_token"] < info["flops_per_token"]
    assert info["final"]["peak_flops_raised_from"] == 1e6 and info["final"]["final_peak_flops"] > 1e6
    assert 0 < summary["cumulative_mfu"] <= 1
    assert capsys.readouterr().out.count("the peak is raised") == 1


def test_step_flops_count_the_attention_pairs_kept():
    """--doc-mask: a step's model FLOPs are 6·N per token + the attention per (query, key) pair kept; with every
    pair of the causal mask that is tokens × mfu_flops_per_token, and two documents of T/2 keep fewer pairs."""
    cfg, rows, t = get_preset("tiny"), 4, 64
    causal = rows * t * (t + 1) // 2
    assert flops.step_flops(cfg, rows * t, causal) == pytest.approx(rows * t * flops.mfu_flops_per_token(cfg, t))
    halves = rows * 2 * (t // 2) * (t // 2 + 1) // 2
    saved = flops.step_flops(cfg, rows * t, causal) - flops.step_flops(cfg, rows * t, halves)
    assert saved == pytest.approx((causal - halves) * flops.attention_flops_per_token(cfg, t) / t)
    meter = flops.MfuMeter(flops_per_token=1e6, peak_flops=1e9)
    assert meter.step(100, 1.0, flops=5e7) == (pytest.approx(0.05), None)  # the given FLOPs, not 100 × 1e6
    meter.step(100, 1.0)
    assert meter.cumulative == pytest.approx((5e7 + 1e8) / 2e9)
