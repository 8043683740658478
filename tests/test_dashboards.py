"""The dashboards: --tensorboard writes metrics.jsonl's figures as TensorBoard events (read back with TensorBoard's
own reader, equal to metrics.jsonl's values; a resumed run appends without a duplicated step; refused in one line
without the package), and --profile-steps writes one Chrome/Perfetto trace per rank of the steps asked for, where a
gloo all-reduce runs beside the backward (one 2-rank launch, which also counts host reads: neither adds one)."""

import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from minidist.comm.launch import run_ranks
from minidist.debug.host_reads import count_run
from minidist.train import loop as train
from minidist.train import run_dir
from minidist.train.config import ConfigError, TrainConfig, parse_config
from minidist.train.dashboard import Dashboard, scalars
from minidist.train.profiling import StepProfiler

MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "max_seq_len": 64}


def config(out, **changes) -> TrainConfig:
    settings = dict(model="tiny", model_overrides=dict(MODEL), max_bytes=100_000, batch_size=8, seq_len=32,
                    steps=4, warmup_steps=1, eval_every=2, eval_batches=2, log_every=1, ckpt_every=0,
                    out=str(out), peak_flops=1e9, plot=False, tensorboard=True)
    return TrainConfig(**{**settings, **changes})


def events(out: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value)]} as TensorBoard shows them (its reader: purges applied, every scalar kept)."""
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    reader = event_accumulator.EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    reader.Reload()
    return {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def f32(value: float) -> float:
    return float(np.float32(value))  # an event holds a float32


def test_events_equal_metrics_and_a_resume_appends(tmp_path):
    out = tmp_path / "run"
    train.train(config(out, stop_after=2, ckpt_every=2))
    first_files = sorted((out / "tensorboard").iterdir())
    train.train(config(out, ckpt_every=2, resume=True))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    got = events(out)
    assert set(first_files) < set((out / "tensorboard").iterdir())  # the resumed run added its file, kept the first
    for name, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"),
                      ("tokens_per_s", "perf/tokens_per_s"), ("mfu", "perf/mfu"), ("step_s", "perf/step_s")):
        assert got[tag] == [(r["step"], f32(r[name])) for r in rows], tag  # every step once, metrics.jsonl's value
    assert got["train/val_loss"] == [(r["step"], f32(r["val_loss"])) for r in rows if "val_loss" in r]
    assert [s for s, _ in got["train/val_loss"]] == [1, 3]
    assert got["memory/peak_bytes/rank0"] == [(r["step"], f32(r["peak_mem_bytes"][0])) for r in rows]


def test_a_resume_purges_the_steps_it_redoes(tmp_path):
    # A run that died after step 3 but resumes from its checkpoint at step 2 writes steps 2 and 3 again: TensorBoard
    # must show the new ones only, once each (metrics.jsonl drops the old ones the same way).
    Dashboard(tmp_path, start_step=0).write([{"step": s, "loss": float(s)} for s in range(4)])
    again = Dashboard(tmp_path, start_step=2)
    again.write([{"step": s, "loss": 10.0 + s} for s in (2, 3)])
    again.close()
    assert events(tmp_path)["train/loss"] == [(0, 0.0), (1, 1.0), (2, 12.0), (3, 13.0)]


def test_every_figure_has_a_tag():
    record = {"step": 5, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.5, "aux_loss": 0.01, "moe_load_imbalance": 1.25,
              "peak_mem_bytes": [10, 20], "fp8_snr_db": {"blocks.0.mlp": [30.0, 40.0]}, "val_loss": float("nan")}
    assert scalars(record) == {
        "train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.5, "train/aux_loss": 0.01,
        "moe/load_imbalance": 1.25, "memory/peak_bytes/rank0": 10.0, "memory/peak_bytes/rank1": 20.0,
        "other/fp8_snr_db/blocks.0.mlp/0": 30.0, "other/fp8_snr_db/blocks.0.mlp/1": 40.0}  # no NaN, no step


def test_without_the_package_the_flag_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(ConfigError) as info:
        parse_config(["--tensorboard"])
    assert "pip install -e '.[tensorboard]'" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="tensorboard"):
        train.train(config(tmp_path / "run"))
    assert not (tmp_path / "run").exists()  # refused before OUT, before any process group
    assert parse_config([]).tensorboard is False  # without the flag, nothing needs it


@pytest.mark.parametrize("spec, words", [
    ("3", "is not A:B"), ("a:b", "is not A:B"), ("-1:2", "is not A:B"), ("1:2:3", "is not A:B"),
    ("3:1", "comes after"), ("2:4", "past the run's last step, 3"),
])
def test_bad_profile_steps_are_one_line(spec, words):
    with pytest.raises(ConfigError) as info:
        parse_config(["--steps", "4", f"--profile-steps={spec}"])
    assert words in str(info.value) and "\n" not in str(info.value)
    assert parse_config(["--steps", "4", "--profile-steps", "0:3"]).profile_steps == "0:3"


def test_a_resume_after_the_profiled_steps_says_so():
    profiler = StepProfiler("1:2", steps=10, out=Path("unused"), rank=0, device=torch.device("cpu"))
    assert profiler.skipped(start_step=2) is None  # step 2 is still to run
    assert "ran before step 3" in profiler.skipped(start_step=3) and "nothing is profiled" in profiler.skipped(3)
    assert StepProfiler(None, 10, Path("unused"), 0, torch.device("cpu")).skipped(5) is None


def test_a_step_that_fails_inside_the_range_writes_the_trace_so_far(tmp_path):
    profiler = StepProfiler("0:3", steps=4, out=tmp_path, rank=0, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="diverged"):
        with profiler.step(0, contextlib.nullcontext) as (autocast, label):
            with autocast(), label("forward_backward"):
                torch.ones(2).sum()
            raise RuntimeError("diverged")
    assert profiler.profiler is None  # stopped: a later profiler in this process can start
    events = json.loads((tmp_path / "profile" / "rank0_steps0-0.json").read_text())["traceEvents"]
    assert {"step 0", "forward", "forward_backward", "aten::sum"} <= {e.get("name") for e in events}


def _rank_run(out: str) -> dict:
    """dp 2, both dashboards on, small buckets (the backward launches many all-reduces); host reads counted. The run
    stops after 3 steps (inside --profile-steps 1:3: it writes steps 1-2's trace) and resumes (step 3's trace)."""
    torch.set_num_threads(1)
    cfg = config(out, microbatches=2, steps=4, eval_every=0, check_every=0, log_every=100, dp=2, bucket_mb=0.02,
                 profile_steps="1:3")
    counts = count_run(dataclasses.replace(cfg, stop_after=3), ops=False)
    train.train(dataclasses.replace(cfg, resume=True))
    return counts


def test_a_trace_per_rank_and_events_from_rank_0(tmp_path):
    ranks = run_ranks(_rank_run, 2, str(tmp_path), timeout=120, threads_per_rank=1)
    for counts in ranks:  # step 1 does not log, and still reads at most one value (tests/test_host_reads.py)
        assert sum(counts["sites"][1].values()) <= 1 and 1 not in counts["logging"], counts["sites"]
    assert sorted(p.name for p in (tmp_path / "profile").iterdir()) == [
        "rank0_steps1-2.json", "rank0_steps3-3.json", "rank1_steps1-2.json", "rank1_steps3-3.json"]
    for rank in range(2):
        resumed = json.loads((tmp_path / "profile" / f"rank{rank}_steps3-3.json").read_text())["traceEvents"]
        assert {"step 3", "forward", "optimizer_step"} <= {e["name"] for e in resumed}
        trace = json.loads((tmp_path / "profile" / f"rank{rank}_steps1-2.json").read_text())
        ranges = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        names = {e["name"] for e in ranges}
        assert {"step 1", "step 2", "forward", "forward_backward", "clip_grad_norm", "optimizer_step"} <= names
        assert not {"step 0", "step 3"} & names  # only the steps asked for, that this run ran
        backward = [e for e in ranges if e["name"].startswith("autograd::engine::evaluate_function")]
        reduces = [e for e in ranges if e["name"] == "gloo:all_reduce"]
        assert backward and reduces, f"rank {rank}: no backward or no gloo all-reduce in the trace"
        overlapping = [g for g in reduces if any(b["ts"] < g["ts"] + g["dur"] and g["ts"] < b["ts"] + b["dur"]
                                                 for b in backward)]
        assert overlapping, f"rank {rank}: no all-reduce overlaps the backward"  # bucketed DP's overlap, visible
    files = list((tmp_path / "tensorboard").iterdir())
    assert len(files) == 2  # rank 0 writes the events (a file per run), every rank's memory among them
    got = events(tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for rank in range(2):
        assert got[f"memory/peak_bytes/rank{rank}"] == [(r["step"], f32(r["peak_mem_bytes"][rank])) for r in rows]


def test_overwrite_removes_the_dashboards_and_nothing_else(tmp_path):
    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    (out / "profile").mkdir()
    (out / "tensorboard" / "events.out.tfevents.1796303822.vm.768.0").write_bytes(b"")
    (out / "profile" / "rank0_steps1-2.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds tensorboard, profile but no run"):  # someone's files: kept
        run_dir.check_out(config(out))
    (out / "run.json").write_text("{}")
    (out / "tensorboard" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="notes.txt, which the trainer did not write"):
        run_dir.check_out(config(out, overwrite=True))
    (out / "tensorboard" / "notes.txt").unlink()
    run_dir.check_out(config(out, overwrite=True))
    assert set(run_dir.clear_run(out)) == {"run.json", "tensorboard", "profile"} and not any(out.iterdir())
