"""The trainer with `--fp8` (chapter 16): every recipe trains within the tolerance FP8 explains of the fp32 run;
tensor parallelism (column- and row-parallel linears, the scales' maxima reduced over tp) logs the one-process FP8
run within fp32 tolerance; every rank runs the FP8 GEMMs it should each step (no silent fallback); blockwise
shards that are not whole blocks are a one-line error before any process group."""

import functools
import json
import math

import pytest
import torch
import trainer_parity
from test_fp8 import CPU_KERNEL, CountScaledMM

from minidist.comm.launch import run_ranks
from minidist.train import loop as train
from minidist.train.config import ConfigError, TrainConfig, check_config
from minidist.train.preflight import resolve_layout

# n_kv_heads 2 splits over tp 2 (kv shards, not replicas: every scale group is one the unsharded layer has).
MODEL = {"n_layers": 2, "d_model": 32, "n_heads": 2, "n_kv_heads": 2, "d_ff": 64, "max_seq_len": 32}
LINEARS = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")  # per block: the FP8 ones (router, head, embedding: not)
STEPS, MICRO, BATCH, SEQ = 3, 2, 4, 32
RECIPES = {"tensorwise": {}, "rowwise": {}, "blockwise": dict(fp8_block=16)}


def config(out: str, **changes) -> TrainConfig:
    settings = dict(model="tiny", model_overrides=dict(MODEL), max_bytes=60_000, val_fraction=0.0,
                    batch_size=BATCH, seq_len=SEQ, microbatches=MICRO, steps=STEPS, warmup_steps=1, grad_clip=1.0,
                    eval_every=0, log_every=1, ckpt_every=0, check_every=0, out=out, seed=0, peak_flops=1e12,
                    plot=False)
    return TrainConfig(**{**settings, **changes})


def expected_gemms(recipe: str) -> dict[str, int]:
    """FP8 GEMMs per step on one rank, by kernel: 3 per FP8 linear and micro-batch (forward, input and weight
    gradients), whatever the recipe or the shard; on a CPU rowwise runs `_scaled_mm`, the others the dequantized
    fp32 matmul (`minidist.model.fp8_gemm`)."""
    return {CPU_KERNEL[recipe]: 3 * len(LINEARS) * MODEL["n_layers"] * MICRO}


def _counted_run(out: str, **changes) -> dict:
    with CountScaledMM() as count:
        summary = train.train(config(out, **changes))
    with open(f"{out}/run.json") as f:
        said = json.load(f)["fp8_gemms"]
    return {"losses": summary["losses"], "gemms": dict(count.kernels), "records": trainer_parity.records(out),
            "said": said}


def _rank_runs(root: str) -> dict:
    runs = {name: _counted_run(f"{root}/tp2_{name}", tp=2, fp8=name, **extra) for name, extra in RECIPES.items()}
    runs["tp2 sp rowwise"] = _counted_run(f"{root}/tp2_sp_rowwise", tp=2, sp=True, fp8="rowwise")
    runs["dp2 rowwise"] = _counted_run(f"{root}/dp2_rowwise", dp=2, fp8="rowwise")
    runs["cp2 rowwise"] = _counted_run(f"{root}/cp2_rowwise", cp=2, fp8="rowwise")
    return runs


@functools.lru_cache(maxsize=1)
def _results(root: str) -> list[dict]:
    return run_ranks(_rank_runs, 2, root, timeout=600, threads_per_rank=1)


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> list[dict]:
    return _results(str(tmp_path_factory.mktemp("fp8_tp")))


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    """One process: fp32, and each recipe (its own runs are the tp runs' reference)."""
    root = tmp_path_factory.mktemp("fp8_single")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = {name: _counted_run(f"{root}/{name}", fp8=name, **extra) for name, extra in RECIPES.items()}
        runs["none"] = _counted_run(f"{root}/none")
        return runs
    finally:
        torch.set_num_threads(threads)


def fp8_loss_tolerance(loss: float) -> float:
    """How far FP8 moves the loss after a few steps. Each GEMM's output carries a relative error of
    δ ≈ √2 · 2^-3/√12 · 0.74 ≈ 3.8% (e4m3, test_fp8.py), independent across output elements; the loss averages
    B·T = 64 tokens' cross-entropies, each a function of a logit vector perturbed through 2 blocks of
    7 linears, so its relative change shrinks like δ/√(B·T) per GEMM and adds over 2·7 GEMMs in quadrature:
    ≈ δ·√14/√64 ≈ 1.8% of the loss; the updates compound it over the steps: we allow 2x that."""
    delta = math.sqrt(2) * 2**-3 / math.sqrt(12) * math.sqrt(3 / (8 * math.log(2)))
    return 2 * delta * math.sqrt(2 * len(LINEARS)) / math.sqrt(BATCH // MICRO * SEQ) * loss


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_recipe_trains_within_fp8_tolerance(recipe, single):
    got, want = single[recipe]["losses"], single["none"]["losses"]
    assert got != want, "the FP8 run must differ from fp32: otherwise its GEMMs did not run in FP8"
    for g, w in zip(got, want):
        assert abs(g - w) < fp8_loss_tolerance(w), (recipe, got, want)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_fp8_gemms_per_step_on_every_rank(recipe, single, tp_results):
    want = {kernel: STEPS * n for kernel, n in expected_gemms(recipe).items()}
    assert single[recipe]["gemms"] == want
    assert single["none"]["gemms"] == {} and single["none"]["said"] == {}
    assert set(single[recipe]["said"].values()) == set(want), "run.json names the kernels that ran"
    for rank, r in enumerate(tp_results):
        assert r[recipe]["gemms"] == want, (recipe, rank)


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_tp_logs_the_one_process_fp8_run(recipe, single, tp_results):
    """The maxima reduced over tp give each rank the unsharded layer's scales, so the first step's loss (a forward
    on the same weights) is the one-process FP8 loss within fp32 reduction-order tolerance. After an update, a
    partial sum rounded in another order (fp32: ~1e-7) can put a value on the other side of an e4m3 rounding
    boundary, moving that element by one FP8 ulp (2^-3): a few such flips among ~10^5 quantized values move the
    loss by ~1e-5 relative (measured: 1.5e-5 blockwise), far below what a wrong scale would (FP8's whole
    error, test_recipe_trains_within_fp8_tolerance: percents). Bound: 1e-4 relative, and < 1/20 of the FP8 effect,
    except rowwise: its bf16 outputs (`first_step_close`) move these first losses as much as e4m3 does (measured on
    step 1, one process: bf16 outputs 8e-5, FP8 with fp32 outputs 3e-5 from fp32), so 1e-4 relative alone."""
    got, want, fp32 = (tp_results[0][recipe]["losses"], single[recipe]["losses"], single["none"]["losses"])
    grads = [r["grad_norm"] for r in tp_results[0][recipe]["records"]]
    assert first_step_close(recipe, got[0], want[0]), (recipe, got, want)
    assert first_step_close(recipe, grads[0], single[recipe]["records"][0]["grad_norm"])
    for g, w, h in zip(got, want, fp32):
        assert abs(g - w) <= 1e-4 * abs(w), (recipe, got, want, fp32)
        assert recipe == "rowwise" or abs(g - w) < abs(w - h) / 20, (recipe, got, want, fp32)
    assert tp_results[1][recipe]["losses"] == got


def first_step_close(recipe: str, got: float, want: float) -> bool:
    """The first step's figure of a tp run against one process's: fp32 reduction-order tolerance, except rowwise,
    whose GEMMs write bf16 (as CUDA's rowwise kernels do): a row-parallel rank's partial sum is rounded to bf16
    before tp sums it, where one process rounds the whole sum once. One bf16 rounding (2^-9 relative at most) of
    those outputs, averaged over the B·T token losses of a step: within 2^-9/√(B·T) relative (measured: 7e-6)."""
    if recipe != "rowwise":
        return trainer_parity.close([got], [want], [1])
    return abs(got - want) <= 2.0**-9 / math.sqrt(BATCH // MICRO * SEQ) * abs(want)


def test_sp_dp_and_cp_under_fp8(single, tp_results):
    """Sequence parallel all-gathers a column-parallel linear's input before its GEMM and reduce-scatters a
    row-parallel one's output after it: the GEMMs, their scales and their bf16 partial sums are tp's, so the same
    tolerance as tp. Data
    parallelism splits the tokens, and with them the weight gradient's scaling groups (its contraction is over the
    tokens) and every tensorwise amax: a different quantization, within the FP8 tolerance of the one-process FP8
    run, but not within fp32's. Context parallelism splits each sequence's tokens over the ranks: the same for the
    weight gradient's scales, and its attention sums in another order; within the FP8 tolerance too."""
    want, fp32 = single["rowwise"]["losses"], single["none"]["losses"]
    sp = tp_results[0]["tp2 sp rowwise"]["losses"]
    assert first_step_close("rowwise", sp[0], want[0]) and all(abs(g - w) <= 1e-4 * w for g, w in zip(sp, want))
    dp = tp_results[0]["dp2 rowwise"]["losses"]
    assert trainer_parity.close(dp[:1], want[:1], [1])  # the first forward: per-row scales do not span tokens
    assert all(abs(g - w) < fp8_loss_tolerance(w) for g, w in zip(dp, want)), (dp, want, fp32)
    cp = tp_results[0]["cp2 rowwise"]["losses"]
    assert cp != fp32 and all(abs(g - w) < fp8_loss_tolerance(w) for g, w in zip(cp, want)), (cp, want, fp32)
    want = {kernel: STEPS * n for kernel, n in expected_gemms("rowwise").items()}
    for r in tp_results:
        assert r["tp2 sp rowwise"]["gemms"] == r["dp2 rowwise"]["gemms"] == r["cp2 rowwise"]["gemms"] == want


@pytest.mark.parametrize("changes, words", [
    (dict(tp=2, fp8="blockwise"), "not multiples of the block 128"),
    (dict(tp=2, fp8="blockwise", fp8_block=32), "pick --fp8-block from [16]"),
    (dict(fp8="fp4"), "fp8 'fp4' is unknown"),
    (dict(fp8="blockwise", fp8_block=0), "fp8_block must be >= 1"),
])
def test_bad_fp8_settings_are_one_line_errors(changes, words):
    with pytest.raises(ConfigError) as info:
        check_config(config("unused", **changes))
        resolve_layout(config("unused", **changes), 2)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_eval_steps_log_each_fp8_layers_snr(tmp_path):
    """An evaluation step logs, per FP8 linear, the SNR of its input's and weight's quantization; e4m3's ideal
    figure is -20 log10 δ = 31.5 dB (test_fp8.py), and a finer scale (rowwise) stays near or above it."""
    summary = train.train(config(str(tmp_path / "snr"), fp8="rowwise", steps=1, val_fraction=0.1, eval_every=1,
                                 eval_batches=1))
    record = trainer_parity.records(str(tmp_path / "snr"))[-1]
    snr = record["fp8_snr_db"]
    assert "val_loss" in record and summary["final_val_loss"] is not None
    assert sorted(snr) == sorted(f"blocks.{i}.{m}.{n}" for i in range(2) for m, names in
                                 (("attn", LINEARS[:4]), ("mlp", LINEARS[4:])) for n in names)
    assert all(28 < x < 45 and 28 < w < 45 for x, w in snr.values()), snr
