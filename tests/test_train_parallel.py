"""The trainer with tensor (chapter 08) and pipeline (chapter 09) parallelism, composed with data parallelism and
ZeRO: every layout logs the single-process run's losses, gradient norms and validation losses; a tp x pp run resumes
exactly from its checkpoint; a layout the pieces cannot run fails with a one-line ConfigError before any process
group exists. One launch of 4 ranks runs every layout in-process through `train(cfg)`."""

import functools
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist
import trainer_parity

from minidist.comm.launch import run_ranks
from minidist.train import checkpoint
from minidist.train import loop as train
from minidist.train.config import ConfigError, TrainConfig
from minidist.train.preflight import resolve_layout

# n_heads 4 and n_kv_heads 2 split over tp 2; 4 layers split over pp 4, or pp 2 x 2 virtual stages.
MODEL = {"n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "max_seq_len": 64}

# name: the layout's settings (every other setting is `config`'s, the same for every layout)
LAYOUTS = {
    "tp2 dp2 zero1": dict(tp=2, dp=2, zero=1),
    "tp2 dp2 zero2": dict(tp=2, dp=2, zero=2),
    "tp2 sp dp2": dict(tp=2, sp=True, dp=2),
    "pp2 dp2 1f1b": dict(pp=2, dp=2, schedule="1f1b"),
    "pp2 dp2 afab zero1": dict(pp=2, dp=2, schedule="afab", zero=1),
    "pp2 tp2 1f1b": dict(pp=2, tp=2, schedule="1f1b"),
    "pp2 tp2 sp interleaved": dict(pp=2, tp=2, sp=True, schedule="interleaved", virtual_stages=2),
    "pp4 1f1b": dict(pp=4, schedule="1f1b"),  # 2 micro-batches < pp: 1F1B still runs
    "pp2 dp2 zb1": dict(pp=2, dp=2, schedule="zb1"),  # chapter 15: the gradient sync after the last W
    # two chunks per rank implied, in a V; zbv needs m >= 2p (the validation batches follow the micro-batch size:
    # this layout's reference runs 4 micro-batches too)
    "pp2 tp2 zbv": dict(pp=2, tp=2, schedule="zbv", microbatches=4),
    "pp2 dp2 dualpipev": dict(pp=2, dp=2, schedule="dualpipev", microbatches=4),  # the same V, DualPipeV's order
    # selective recomputation replays the tp collectives between the matmuls in the backward, in the same order
    "pp2 tp2 sp selective": dict(pp=2, tp=2, sp=True, recompute="selective"),
}


def config(out: str, **changes) -> TrainConfig:
    """4 steps of batch 8 x 32 with clipping active (the norm is above 1 at the start) and 2 evaluations."""
    settings = dict(model="tiny", model_overrides=dict(MODEL), max_bytes=100_000, batch_size=8, seq_len=32,
                    microbatches=2, steps=4, warmup_steps=1, grad_clip=1.0, eval_every=2, eval_batches=2,
                    log_every=100, ckpt_every=0, out=out, seed=0, peak_flops=1e12, plot=False)
    return TrainConfig(**{**settings, **changes})


def _rank_layouts(root: str) -> dict:
    """The rank function: every layout through `train.train`, then a tp2 x pp2 run resumed from step 2."""
    results = trainer_parity.train_layouts(root, LAYOUTS, config)
    out = str(Path(root) / "resume")
    first = train.train(config(out, pp=2, tp=2, ckpt_every=2))
    dist.barrier()
    if dist.get_rank() == 0:  # pretend the run died after the step-2 checkpoint
        ckpts = Path(out) / "checkpoints"
        shutil.rmtree(ckpts / checkpoint.step_dir_name(4))
        (ckpts / checkpoint.LATEST).write_text(checkpoint.step_dir_name(2) + "\n")
    dist.barrier()
    again = train.train(config(out, pp=2, tp=2, ckpt_every=2, resume=True))
    results["resume"] = {"losses": first["losses"], "resumed_losses": again["losses"],
                         "resumed_from": again["resumed_from"], "hash": first["param_hash"],
                         "resumed_hash": again["param_hash"]}
    # Chapter 15: a zbv checkpoint (chunks in a V) resumed as 1f1b (chunks in a line) is a resharding resume.
    out = str(Path(root) / "resume_zbv")
    zbv = train.train(config(out, pp=2, tp=2, schedule="zbv", microbatches=4, ckpt_every=2, stop_after=2))
    as_1f1b = train.train(config(out, pp=2, tp=2, schedule="1f1b", microbatches=4, ckpt_every=2, resume=True))
    results["resume_zbv"] = {"losses": zbv["losses"], "resumed_losses": as_1f1b["losses"],
                             "resumed_from": as_1f1b["resumed_from"]}
    return results


@functools.lru_cache(maxsize=1)
def _results(root: str) -> list[dict]:
    return run_ranks(_rank_layouts, 4, root, timeout=900, threads_per_rank=1)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return _results(str(tmp_path_factory.mktemp("layouts")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """The single-process run (no process group) of the same settings."""
    return trainer_parity.single_process_records(str(tmp_path_factory.mktemp("single")), config)


@pytest.fixture(scope="module")
def reference_m4(tmp_path_factory) -> list[dict]:
    """The single-process run with 4 micro-batches (for zbv, which needs m >= 2p)."""
    return trainer_parity.single_process_records(str(tmp_path_factory.mktemp("single_m4")),
                                                 functools.partial(config, microbatches=4))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_logs_the_single_process_run(name, results, reference, request) -> None:
    """Losses (global mean over replicas), gradient norms (over tp shards and pp stages, before clipping; clipping
    is active, so a wrong norm changes the later losses) and validation losses match one process."""
    if LAYOUTS[name].get("microbatches") == 4:
        reference = request.getfixturevalue("reference_m4")
    records = results[0][name]["records"]
    trainer_parity.assert_logs_match(name, records, reference)
    for r in results:  # every rank returns the same (global) losses
        assert r[name]["losses"] == results[0][name]["losses"]
    assert reference[0]["grad_norm"] > 1.0  # the clipping above was active


def test_tp_pp_run_resumes_exactly(results) -> None:
    for r in results:
        out = r["resume"]
        assert out["resumed_from"] == 2
        assert out["resumed_losses"] == out["losses"][2:]
        assert out["resumed_hash"] == out["hash"]  # each rank's part of the parameters, bit for bit


def test_a_zbv_checkpoint_resumes_as_1f1b(results, request) -> None:
    reference = request.getfixturevalue("reference_m4")
    for r in results:
        out = r["resume_zbv"]
        assert out["resumed_from"] == 2 and len(out["losses"]) == 2
        got, want = out["losses"] + out["resumed_losses"], [rec["loss"] for rec in reference]
        assert trainer_parity.close(got, want, [rec["step"] + 1 for rec in reference]), (
            f"zbv run resumed as 1f1b: losses {got} != single process {want}")


def _error(world: int, **changes) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_layout(config("unused", **changes), world)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("world, changes, words", [
    (3, dict(tp=3), "does not divide n_heads=4"),
    (4, dict(pp=4, model_overrides=dict(MODEL, n_layers=2)), "fewer than the 4 pipeline chunks"),
    (1, dict(sp=True), "needs --tp > 1"),
    (2, dict(tp=2, sp=True, seq_len=33, model_overrides=dict(MODEL, max_seq_len=64)), "seq_len=33 divisible"),
    (2, dict(pp=2, virtual_stages=2), "needs schedule='interleaved'"),
    (1, dict(virtual_stages=2), "needs --pp > 1"),
    (4, dict(pp=4, microbatches=1, schedule="interleaved", virtual_stages=1), "microbatches >= pp"),
    (2, dict(pp=2, schedule="zbv", microbatches=2), "zbv needs microbatches >= 2*pp"),
    (2, dict(pp=2, schedule="dualpipev", microbatches=2), "dualpipev needs microbatches >= 2*pp"),
    (2, dict(pp=2, schedule="dualpipev", virtual_stages=3, microbatches=4), "dualpipev places exactly two chunks"),
    (2, dict(pp=2, schedule="zb1", virtual_stages=2), "zb1 runs one chunk per rank"),
    (2, dict(pp=2, schedule="zb2"), "unknown pipeline schedule 'zb2'"),
])
def test_bad_layouts_are_one_line_errors(world, changes, words) -> None:
    """Checked by `resolve_layout`, which runs before any process group is created."""
    assert words in _error(world, **changes)
