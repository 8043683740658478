"""The trainer with context parallelism (chapter 10), composed with data parallelism + ZeRO, pipeline and tensor +
sequence parallelism: every layout logs the single-process run's losses, gradient norms and validation losses; a
layout that cannot work fails with a one-line ConfigError before any process group exists. One launch of 4 ranks
runs every layout through `train(cfg)`."""

import functools

import pytest
import trainer_parity

from minidist.comm.launch import run_ranks
from minidist.train.config import ConfigError, TrainConfig, check_config
from minidist.train.preflight import resolve_layout

MODEL = {"n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "max_seq_len": 64}

LAYOUTS = {
    "cp2 dp2 ring zero2": dict(cp=2, dp=2, zero=2, cp_impl="ring"),
    "cp2 pp2 allgather": dict(cp=2, pp=2, cp_impl="allgather"),
    "cp2 tp2 sp ulysses": dict(cp=2, tp=2, sp=True, cp_impl="ulysses"),  # 1 kv head per tp rank, replicated to 2
}


def config(out: str, **changes) -> TrainConfig:
    """4 steps of batch 8 x 32 in 2 micro-batches, clipping active, 2 evaluations."""
    settings = dict(model="tiny", model_overrides=dict(MODEL), max_bytes=100_000, batch_size=8, seq_len=32,
                    microbatches=2, steps=4, warmup_steps=1, grad_clip=1.0, eval_every=2, eval_batches=2,
                    log_every=100, ckpt_every=0, out=out, seed=0, peak_flops=1e12, plot=False)
    return TrainConfig(**{**settings, **changes})


def _rank_layouts(root: str) -> dict:
    return trainer_parity.train_layouts(root, LAYOUTS, config)


@functools.lru_cache(maxsize=1)
def _results(root: str) -> list[dict]:
    return run_ranks(_rank_layouts, 4, root, timeout=600, threads_per_rank=1)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return _results(str(tmp_path_factory.mktemp("cp_layouts")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    return trainer_parity.single_process_records(str(tmp_path_factory.mktemp("single")), config)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_logs_the_single_process_run(name, results, reference) -> None:
    records = results[0][name]["records"]
    trainer_parity.assert_logs_match(name, records, reference)
    for r in results:  # every rank returns the same (global) losses
        assert r[name]["losses"] == results[0][name]["losses"]
    assert reference[0]["grad_norm"] > 1.0  # the clipping above was active


@pytest.mark.parametrize("world, changes, words", [
    (4, dict(cp=2, seq_len=30), "seq_len=30 does not split into 2·cp chunks (zig-zag) = 4"),
    (8, dict(cp=8, cp_impl="ulysses"), "ulysses splits the 4 attention heads per tp rank over cp=8"),
    (4, dict(cp=2, tp=2, cp_impl="ulysses", model_overrides=dict(MODEL, n_heads=2, n_kv_heads=2)),
     "ulysses splits the 1 attention heads per tp rank over cp=2"),
    (4, dict(cp=2, tp=2, sp=True, seq_len=36), None),  # 36 = 4 zig-zag chunks of 9; 18 per rank over tp 2
])
def test_bad_layouts_are_one_line_errors(world, changes, words) -> None:
    """Checked by `resolve_layout`, which runs before any process group is created."""
    cfg = config("unused", **changes)
    if words is None:
        resolve_layout(cfg, world)
        return
    with pytest.raises(ConfigError) as info:
        resolve_layout(cfg, world)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_unknown_cp_impl_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"cp_impl 'striped' is unknown; choose one of \('ring', 'allgather', "):
        check_config(config("unused", cp_impl="striped"))
