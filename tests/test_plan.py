"""The layout planner (minidist.plan.search): its command line, the token-count parse, one-line errors, memory
rejections with their reasons, and a step time checked by hand on a small case."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from minidist.comm.cost_model import alpha_beta_time
from minidist.flops import count_params, mfu_flops_per_token
from minidist.hardware import Link
from minidist.model import get_preset
from minidist.parallel import Layout
from minidist.plan.cli import main
from minidist.plan.cluster import Cluster
from minidist.plan.rank_memory import FP32, estimate_memory
from minidist.plan.search import JSON_KEYS, global_batch_sequences, parse_tokens, rank_of, search
from minidist.plan.step_time import predict_step

TINY_ARGS = ["--model", "tiny", "--gpus", "8", "--gpu", "H100-SXM", "--seq-len", "256",
             "--global-batch-tokens", "64K"]


def test_help_explains_the_planner():
    out = subprocess.run([sys.executable, "-m", "minidist.plan", "--help"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    for flag in ("--model", "--gpus", "--gpus-per-node", "--gpu", "--seq-len", "--global-batch-tokens", "--top",
                 "--json"):
        assert flag in out
    assert "4,194,304" in out and "deepseek-v3" in out and "llama3-405b" in out and "H800" in out


def test_token_counts_are_powers_of_two():
    assert parse_tokens("4M") == 4_194_304 == 512 * 8192
    assert parse_tokens("64K") == 65536 and parse_tokens("1G") == 2**30 and parse_tokens("1000") == 1000
    assert global_batch_sequences(parse_tokens("4M"), 8192) == 512
    for bad in ("4.5M", "-1", "M", "4T"):
        with pytest.raises(ValueError, match="not a positive whole number"):
            parse_tokens(bad)


@pytest.mark.parametrize("argv, needle", [
    (["--seq-len", "8192", "--global-batch-tokens", "4194305"], "4,194,305 is not a multiple of --seq-len 8192"),
    (["--gpu", "RTX-9090"], "--gpu 'RTX-9090' is unknown"),
    (["--model", "gpt5"], "--model 'gpt5' is neither a preset"),
    (["--gpus", "0"], "--gpus must be >= 1"),
])
def test_bad_input_is_one_line(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and needle in err, err
    if "multiple" in needle:
        assert "4,194,304 (512 sequences)" in err  # what would fit


def test_json_lists_feasible_layouts_fastest_first(capsys):
    assert main([*TINY_ARGS, "--json", "--top", "5"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert 1 <= len(rows) <= 5
    assert all(tuple(row) == JSON_KEYS for row in rows)
    assert [r["step_s"] for r in rows] == sorted(r["step_s"] for r in rows)
    for r in rows:
        assert r["dp"] * r["tp"] * r["pp"] * r["cp"] == 8 and (r["dp"] * r["cp"]) % r["ep"] == 0
        assert r["mem_gib"] <= 0.9 * 80


def _toy_cluster(memory: float, alpha: float = 1e-3) -> Cluster:
    link = Link("toy", bandwidth=1e9, latency=alpha)
    return Cluster("toy", peak_flops=1e12, memory_bytes=memory, gpus_per_node=8, intra=link, inter=link,
                   efficiency=0.5, usable_memory=1.0)


def test_step_time_by_hand_dp2():
    """dp 2, one micro-batch: compute = FLOPs/2 at half of 1 TFLOP/s; the gradient all-reduce (ring: 2(p−1) steps,
    2(p−1)/p of the bytes) hides behind the backward (2/3 of the compute), the rest is exposed."""
    cfg = get_preset("tiny")
    seq, batch = 128, 8
    t = predict_step(cfg, Layout.of(dp=2), seq, batch, _toy_cluster(1e12, alpha=1e-3), FP32)
    compute = mfu_flops_per_token(cfg, seq) * seq * batch / 2 / (1e12 * 0.5)
    grads = 4 * count_params(cfg)
    all_reduce = 2 * 1e-3 + grads / 1e9  # 2 steps of α; 2·(1/2)·M bytes at 1 GB/s
    assert all_reduce == pytest.approx(alpha_beta_time("all_reduce", grads, 2, 1e-3, 1e-9))
    assert t.compute == pytest.approx(compute)
    assert t.dp == pytest.approx(max(0.0, all_reduce - 2 * compute / 3))
    assert t.total == pytest.approx(compute + t.dp)
    assert t.tp == t.cp == t.ep == t.pp == t.bubble == 0


def test_layouts_over_memory_are_rejected_with_reasons(capsys):
    cfg = get_preset("tiny")
    whole = estimate_memory(cfg, Layout.of(dp=4), 256, 4).total  # dp 4, no ZeRO: everything on every rank
    plan = search(cfg, 4, 256, 16 * 256, _toy_cluster(0.9 * whole), FP32)
    assert plan.feasible and plan.rejected
    assert all(c.memory.total <= plan.budget for c in plan.feasible)
    assert all(c.memory.total > plan.budget for c in plan.rejected)
    place, plain = rank_of(plan, dp=4, zero=0, microbatches=1, recompute="none")
    assert place is None and plain.memory.total == pytest.approx(whole)
    # the same shape sharded (ZeRO-3) or recomputed fits
    assert rank_of(plan, dp=4, zero=3)[0] is not None


def test_text_report_says_why_faster_layouts_fail(capsys):
    # 8B on 8 GPUs, 2 sequences of 8192 per GPU: the fastest layouts hold everything (no ZeRO) or whole batches
    assert main(["--model", "llama3-8b", "--gpus", "8", "--seq-len", "8192", "--global-batch-tokens", "128K",
                 "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "layouts fit" in out and "step = (compute" in out
    why = out.split("do not fit, and why:\n")[1].split("\n\n")[0].splitlines()
    assert len(why) == 3 and all("GiB usable (params" in line for line in why)
    assert "not layouts" in out and "fewer micro-batches than stages" in out


def test_heaviest_stage_is_found_in_the_middle():
    """DeepSeek-V3's first three layers are dense: with pp 32 the third stage holds two MoE blocks to the first's
    one and every stage's experts whole (ep 1). dp16 cp4 pp32 ep1 ZeRO-1 on 2,048 H800 must not fit, even with one
    sequence per micro-batch; the first and the last stage alone (the old rule) said it did (40.2 and 49.9 GiB)."""
    from minidist.hardware import GIB
    from minidist.plan.rank_memory import BF16_MIXED, stage_classes

    cfg = get_preset("deepseek-v3")
    layout = Layout.of(dp=16, cp=4, pp=32, ep=1, zero=1, microbatches=960)  # 15,360 sequences / dp 16 = 960
    worst = estimate_memory(cfg, layout, 4096, 1, BF16_MIXED)
    every = [estimate_memory(cfg, layout, 4096, 1, BF16_MIXED, s) for s in range(32)]
    assert worst.total == max(e.total for e in every) and worst.stage not in (0, 31)
    assert max(every[0].total, every[31].total) < 0.9 * 80 * GIB < worst.total
    assert worst.total / GIB == pytest.approx(139.6, abs=0.1)
    # stages with the same blocks and role: only the one with the most in flight can be the heaviest
    assert len(stage_classes(cfg, layout)) <= 5


def test_a_layout_over_budget_on_its_first_stage_is_rejected_without_the_others():
    """The search's shortcut: a layout whose first stage alone is over the budget is rejected after evaluating that
    stage only; completed (`Plan.heaviest`), it is what the full evaluation gives, over the budget as well, and
    every layout the search keeps or rejects whole is evaluated in full."""
    cfg = get_preset("small")
    gpus, seq_len, sequences = 8, 256, 64
    budget = 0.5 * estimate_memory(cfg, Layout.of(dp=8), seq_len, sequences // 8, FP32).total
    plan = search(cfg, gpus, seq_len, sequences * seq_len, _toy_cluster(budget), FP32)
    cut = [c for c in plan.rejected if c.over_at_first_stage]
    assert cut and plan.feasible and len(cut) < len(plan.rejected)
    for c in cut + plan.feasible + [c for c in plan.rejected if not c.over_at_first_stage]:
        micro_batch = sequences // (c.layout.dims.dp * c.layout.options.microbatches)
        full = estimate_memory(cfg, c.layout, seq_len, micro_batch, FP32)
        assert plan.heaviest(c).memory == full and not plan.heaviest(c).over_at_first_stage
        if c.over_at_first_stage:
            assert c.memory.stage == 0 and full.total >= c.memory.total > budget
        assert (full.total <= budget) == c.fits


def test_huge_inputs_answer_quickly_or_refuse_in_one_line(capsys):
    from minidist.plan.search import _divisors

    assert _divisors(10**12)[:4] == (1, 2, 4, 5) and len(_divisors(10**12)) == 169  # 13 x 13 exponents of 2 and 5
    assert main(["--gpus", str(10**12)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "more than any layout can use" in err
    # a million micro-batches: the interleaved peak in flight is a formula, no schedule built
    from minidist.plan.stages import chunks_in_flight
    assert chunks_in_flight("interleaved", 4, 4 * 10**6, 2, 0) == chunks_in_flight("interleaved", 4, 8, 2, 0)
    assert chunks_in_flight("interleaved", 64, 8 * 10**6 + 1, 8, 0) == 2 * 63 + 7 * 65 + 1  # groups of 64 and 65
    assert main(["--model", "tiny", "--gpus", "8", "--seq-len", "256", "--global-batch-tokens", "1000G",
                 "--top", "1", "--json"]) == 0


LLAMA_16K = ["--model", "llama3-405b", "--gpus", "16384", "--gpu", "H100-SXM", "--seq-len", "8192",
             "--global-batch-tokens", "16M"]


def test_explain_prints_every_stage_and_the_terms(capsys):
    assert main([*LLAMA_16K, "--explain", "dp=128 tp=8 pp=16 cp=1 ep=1"]) == 0
    out = capsys.readouterr().out.split("\n\n")[-1]
    stages = [line for line in out.splitlines() if line[:5].strip().isdigit()]
    assert len(stages) == 16 and sum("<- heaviest" in line for line in stages) == 1
    assert "compute" in out and "bubble" in out and "dp exposed" in out and "not modelled: kernels' efficiency" in out
    assert "queries meet up to 8,192 keys per kernel, 100% of their work under the causal mask" in out
    assert main([*LLAMA_16K, "--explain", "dp=32 tp=4 pp=16 cp=8 ep=1"]) == 0  # a ring: chunks, 1/16 causal
    assert "queries meet up to 1,024 keys per kernel, 6% of their work under the causal mask" in capsys.readouterr().out
    assert main([*LLAMA_16K, "--explain", "dp=128 tp=8 pp=16 cp=1 ep=1", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert tuple(row)[:-1] == JSON_KEYS and row["fits"] is True and row["rank"] > 1
    assert (row["dp"], row["tp"], row["pp"], row["virtual_stages"]) == (128, 8, 16, 8)  # uneven chunks interleave
    assert 0.75 <= row["step_s"] / 6.5 <= 1.25  # the published step: 400 TFLOP/s per GPU (docs/PUBLISHED_RUNS.md)
    # a layout the search refuses is evaluated as given; a bad setting is one line
    assert main([*TINY_ARGS, "--explain", "dp=8 recompute=selective", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recompute"] == "selective"
    assert main([*TINY_ARGS, "--explain", "dq=8"]) == 2
    assert "is not SETTING=VALUE" in capsys.readouterr().err


def test_published_llama_rows_are_the_docs():
    """docs/PUBLISHED_RUNS.md's Llama 3 rows are what `plan.published` computes now (the DeepSeek-V3 row, a longer
    search, is checked by notebook 12)."""
    from pathlib import Path

    from minidist.plan.published import hold, published_runs, table

    docs = (Path(__file__).parent.parent / "docs" / "PUBLISHED_RUNS.md").read_text()
    for row in table([hold(run) for run in published_runs()[:3]]).splitlines()[2:]:
        assert row in docs, row
