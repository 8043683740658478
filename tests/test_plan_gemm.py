"""GEMM rates by shape (minidist.plan.gemm_table): the linears' shapes against the planner's own FLOP count, the
table's interpolation and harmonic mean, the planner's step time with a table, the table read as untrusted input,
and --measure-gemms / --gemm-table on the command line."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minidist.flops import matmul_params
from minidist.model import get_preset
from minidist.model.config import MLAConfig, MoEConfig
from minidist.parallel import Layout
from minidist.plan import cli
from minidist.plan.cluster import cluster_for_chip
from minidist.plan.gemm_table import (
    MEASURE_ROWS,
    GemmTable,
    layer_gemms,
    linear_rate,
    load_gemm_table,
    model_gemm_grid,
    training_gemms,
)
from minidist.plan.rank_memory import BF16_MIXED
from minidist.plan.stages import busiest_stage_kinds
from minidist.plan.step_time import predict_step, step_flops_per_rank

SEQ, SEQUENCES = 4096, 64
ROOT = Path(__file__).resolve().parents[1]


def forward_flops(cfg, tp: int, tokens: int, ep: int = 1) -> float:
    """2·m·k·n over one micro-batch's forward GEMMs of every layer (one pipeline stage holding them all)."""
    rows = tokens * cfg.moe.top_k * ep / cfg.moe.n_experts if cfg.moe.n_experts else 0.0
    gemms = layer_gemms(cfg, tp, tokens, rows, ep)
    kinds = busiest_stage_kinds(cfg, 1, 1, "1f1b")
    return sum(layers * 2.0 * m * k * n * count for kind, layers in zip(("dense", "moe"), kinds, strict=True)
               for (m, k, n), count in gemms[kind])


MOE_MLA = dict(attention="mla", mla=MLAConfig(q_lora_rank=None), moe=MoEConfig(n_experts=4, top_k=2, n_shared_experts=1,
                                                                            d_expert=96, first_dense_layers=1))


@pytest.mark.parametrize("preset, extra", [("llama3-8b", {}), ("gpt2-124m", {}), ("deepseek-v3", {}),
                                           ("tiny", MOE_MLA)])
def test_linears_shapes_are_the_models_weights(preset, extra):
    """The forward GEMMs of every layer are 2·tokens·N of the blocks' matmul weights (`flops.matmul_params`
    without the head): the shapes are the model's, each weight once (GQA, GELU, MLA with and without the query's
    latent, routed and shared experts, a router, dense first layers)."""
    cfg = get_preset(preset, **extra)
    blocks = matmul_params(cfg) - cfg.d_model * cfg.vocab_size
    assert forward_flops(cfg, 1, SEQ) == 2.0 * SEQ * blocks


@pytest.mark.parametrize("preset, tp", [("llama3-8b", 4), ("gpt2-124m", 2), ("llama3-405b", 8)])
def test_dense_shards_split_the_work(preset, tp):
    """A dense model's GEMMs on one tp rank are 1/tp of one process's (heads, kv heads and d_ff divide by tp), and
    their training FLOPs (forward, input and weight gradients) are `step_flops_per_rank`'s linears to within its
    causal diagonal's count (its linears hold the half pair per query that the causal attention term leaves out)."""
    cfg = get_preset(preset)
    assert forward_flops(cfg, tp, SEQ) * tp == forward_flops(cfg, 1, SEQ)
    linears = step_flops_per_rank(cfg, Layout.of(dp=1, tp=tp, pp=1, microbatches=1), SEQ, 1).linears
    assert 3 * forward_flops(cfg, tp, SEQ) == pytest.approx(linears, rel=2e-4)


def test_training_gemms_transpose_and_count():
    """The input gradient is (m, n, k), the weight gradient (k, m, n) with the rows as its reduction (axis 1);
    full recomputation runs the forward twice."""
    out = training_gemms([((8, 3, 5), 2.0)], forwards=2)
    assert out == [((8, 3, 5), 0, 4.0), ((8, 5, 3), 0, 2.0), ((3, 8, 5), 1, 2.0)]


def test_table_interpolates_in_log_rows_and_refuses_outside():
    table = GemmTable("NVIDIA H100 80GB HBM3", "bfloat16", {(128, 64, 32): 1e12, (512, 64, 32): 3e12,
                                                            (64, 128, 32): 5e12})
    assert table.rate(128, 64, 32) == 1e12 and table.rate(512, 64, 32) == 3e12
    assert table.rate(256, 64, 32) == pytest.approx(2e12)  # halfway in log2 between 128 and 512
    assert table.rate(64, 64, 32) is None and table.rate(1024, 64, 32) is None  # outside the measured rows
    assert table.rate(256, 64, 16) is None  # other sizes never measured
    assert table.rate(64, 128, 32, rows_axis=1) == 5e12  # a weight gradient's rows are its k
    assert table.rate(64, 256, 32, rows_axis=1) is None
    moved = dataclasses.replace(table, rates={(128, 64, 32): 4e12})  # a copy indexes its own rates only
    assert moved.rate(128, 64, 32) == 4e12 and moved.rate(512, 64, 32) is None and table.rate(128, 64, 32) == 1e12


def test_linear_rate_is_the_flop_weighted_harmonic_mean():
    """Two GEMMs of equal FLOPs at r and 2r take 1/r + 1/(2r) = 1.5/r seconds per FLOP pair: 4r/3 together;
    a shape outside the table runs at the fallback and is counted."""
    table = GemmTable("gpu", "bfloat16", {(64, 64, 64): 1e12, (64, 32, 128): 2e12})
    rate, missing = linear_rate(table, [((64, 64, 64), 0, 1.0), ((64, 32, 128), 0, 1.0)], fallback=7e12)
    assert rate == pytest.approx(4e12 / 3) and missing == 0
    rate, missing = linear_rate(table, [((64, 64, 64), 0, 1.0), ((64, 16, 256), 0, 1.0)], fallback=3e12)
    assert rate == pytest.approx(2 / (1 / 1e12 + 1 / 3e12)) and missing == 1


def _uniform_table(cfg, rate: float, tps=(1, 2), rows=(1024, 2048, 4096, 8192)) -> GemmTable:
    return GemmTable("NVIDIA H100 80GB HBM3", "bfloat16", {s: rate for s in model_gemm_grid(cfg, tps, rows)})


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_step_time_with_a_table(recompute):
    """A table at the cluster's own rate predicts the step without one; at half that rate the compute grows by
    exactly the linears' FLOPs at the rate; a shape outside the table is counted and runs at the efficiency."""
    cfg = get_preset("llama3-8b")
    cluster = cluster_for_chip("H100-SXM", efficiency=None)
    rate = cluster.peak_flops * cluster.efficiency
    layout = Layout.of(dp=8, tp=2, pp=2, microbatches=4, recompute=recompute)
    plain = predict_step(cfg, layout, SEQ, SEQUENCES, cluster, BF16_MIXED)
    same = predict_step(cfg, layout, SEQ, SEQUENCES, dataclasses.replace(cluster, gemm_table=_uniform_table(cfg, rate)),
                        BF16_MIXED)
    assert same.total == pytest.approx(plain.total, rel=1e-12) and same.linear_rate == pytest.approx(rate)
    assert same.unmeasured == 0 and plain.linear_rate == 0
    half = predict_step(cfg, layout, SEQ, SEQUENCES,
                        dataclasses.replace(cluster, gemm_table=_uniform_table(cfg, rate / 2)), BF16_MIXED)
    linears = step_flops_per_rank(cfg, layout, SEQ, SEQUENCES).linears
    assert half.compute - plain.compute == pytest.approx(linears / rate, rel=1e-9)
    narrow = predict_step(cfg, layout, SEQ, SEQUENCES,
                          dataclasses.replace(cluster, gemm_table=_uniform_table(cfg, rate / 2, tps=(1,))), BF16_MIXED)
    assert narrow.unmeasured > 0 and plain.compute < narrow.compute < half.compute  # tp 2's shapes at the efficiency


def test_table_round_trips_and_hostile_tables_are_refused(tmp_path):
    table = _uniform_table(get_preset("tiny"), 3e12, rows=(128, 256))
    path = tmp_path / "t.json"
    path.write_text(table.to_json())
    loaded = load_gemm_table(path)
    assert loaded.rates == table.rates and loaded.device == table.device and loaded.source == str(path)
    good = json.loads(path.read_text())
    cases = {
        "not JSON": "{rows",
        "not a minidist-gemm/1 table": json.dumps({**good, "format": "pickle"}),
        "device and dtype must be names": json.dumps({**good, "device": 7}),
        "rows must be a list of 1 to": json.dumps({**good, "rows": []}),
        "row 0 is": json.dumps({**good, "rows": [[1, 2, 3, math.nan]]}).replace("NaN", "NaN"),
        "row 1 is": json.dumps({**good, "rows": [[1, 2, 3, 1e12], [True, 2, 3, 1e12]]}),
        "row 2 is": json.dumps({**good, "rows": [[1, 2, 3, 1e12], [2, 2, 3, 1e12], [0, 2, 3, 1e12]]}),
        "a second time": json.dumps({**good, "rows": [[1, 2, 3, 1e12], [1, 2, 3, 2e12]]}),
    }
    for needle, text in cases.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=needle) as info:
            load_gemm_table(path)
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="not a regular file"):
        load_gemm_table(tmp_path)


def test_measure_and_plan_on_the_command_line(tmp_path, capsys, monkeypatch):
    """--measure-gemms writes this CPU's table (progress on stderr); the command line refuses to plan a GPU with a
    CPU's table, in one line; a GPU's table is used, and --explain says at what rate the linears ran."""
    monkeypatch.setattr(cli, "MEASURE_ROWS", (128, 256))
    out = tmp_path / "gemms.json"
    assert cli.main(["--model", "tiny", "--gpus-per-node", "2", "--measure-gemms", str(out),
                     "--measure-seconds", "0.01"]) == 0
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.out and "measured" in captured.err
    table = load_gemm_table(out)
    assert set(table.rates) == set(model_gemm_grid(get_preset("tiny"), [1, 2], (128, 256)))
    args = ["--model", "tiny", "--gpus", "4", "--gpus-per-node", "2", "--seq-len", "256",
            "--global-batch-tokens", "64K", "--gemm-table", str(out)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "measured on a CPU" in err
    out.write_text(dataclasses.replace(table, device="NVIDIA H100 80GB HBM3").to_json())
    assert cli.main([*args, "--explain", "dp=2 tp=2 pp=1"]) == 0
    report = capsys.readouterr().out
    assert "GEMM rates by shape measured on NVIDIA H100 80GB HBM3" in report
    assert "the blocks' linears:" in report and "TFLOP/s by their shapes' measured rates" in report
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere, target_is_directory=True)
    assert cli.main(["--model", "tiny", "--measure-gemms", str(tmp_path / "link" / "t.json")]) == 2
    assert "symbolic link" in capsys.readouterr().err and not any(elsewhere.iterdir())
    assert cli.main(["--model", "tiny", "--measure-gemms", str(out), "--measure-seconds", "0"]) == 2
    assert "--measure-seconds must be in (0, 60]" in capsys.readouterr().err


@pytest.mark.timeout(240)
def test_prepared_gpu_script_cpu_path(tmp_path):
    """scripts/measure_gemms.sh, the prepared run for a GPU machine: its CPU path measures the table and says that
    it plans nothing with it (a CPU's rates cannot plan a GPU)."""
    env = {**os.environ, "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "measure_gemms.sh"), "--model", "tiny", "--seconds",
                             "0.002", "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=230)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "no GPU here, the table is measured only" in result.stdout
    table = load_gemm_table(tmp_path / "tiny.json")
    assert table.device.startswith("cpu") and set(table.rates) == set(model_gemm_grid(get_preset("tiny"), [1, 2, 4],
                                                                                      MEASURE_ROWS))
