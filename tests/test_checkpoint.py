"""Tests for checkpoints: the on-disk layout, atomic publication, per-rank files, and exact resume of a run."""

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from minidist.train import checkpoint, reshard
from minidist.train import loop as train
from minidist.train.config import ConfigError, TrainConfig

SMALL_MODEL = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "max_seq_len": 64}
TIMING = {"tokens_per_s", "mfu", "step_s", "peak_mem_bytes"}  # fields that measure the machine, not the math


def small_config(out, **changes) -> TrainConfig:
    settings = dict(model="tiny", model_overrides=dict(SMALL_MODEL), data="stdlib", max_bytes=100_000,
                    batch_size=8, seq_len=32, microbatches=2, steps=6, warmup_steps=2, eval_every=2, eval_batches=2,
                    log_every=100, ckpt_every=3, out=str(out), peak_flops=1e9, plot=False)
    settings.update(changes)
    return TrainConfig(**settings)


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def without_timing(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


MOE = {**SMALL_MODEL, "moe": {"n_experts": 4, "top_k": 2, "d_expert": 64, "bias_update_speed": 0.01}}


@pytest.mark.parametrize("model", [SMALL_MODEL, MOE], ids=["dense", "moe"])
def test_resume_is_bitwise_exact(tmp_path, model):
    out = tmp_path / "run"
    full = train.train(small_config(out, model_overrides=model))
    uninterrupted = records(out)
    final_model = reshard.read_full_model(out / "checkpoints" / "step_000006")

    # Pretend the run crashed after step 5 with its last checkpoint at step 3: metrics hold steps 0..5.
    shutil.rmtree(out / "checkpoints" / "step_000006")
    (out / "checkpoints" / "latest").write_text("step_000003\n")
    resumed = train.train(small_config(out, model_overrides=model, resume=True))

    assert resumed["resumed_from"] == 3 and resumed["steps"] == [3, 4, 5]
    assert resumed["losses"] == full["losses"][3:]  # bitwise: == on floats
    assert resumed["val_losses"] == {k: v for k, v in full["val_losses"].items() if k >= 3}
    assert without_timing(records(out)) == without_timing(uninterrupted)  # each step logged once, same values
    model = reshard.read_full_model(out / "checkpoints" / "step_000006")
    assert sorted(model) == sorted(final_model) and all(torch.equal(model[k], final_model[k]) for k in final_model)


def test_resume_keeps_the_checkpoints_optimizer_settings(tmp_path, capsys):
    """The param groups' settings are restored as torch's load_state_dict would: a resume asked for another weight
    decay and beta1 continues with the checkpoint's (bitwise the uninterrupted run) and says so in one line."""
    out = tmp_path / "run"
    full = train.train(small_config(out, steps=4, ckpt_every=2))
    shutil.rmtree(out / "checkpoints" / "step_000004")
    (out / "checkpoints" / "latest").write_text("step_000002\n")
    capsys.readouterr()
    resumed = train.train(small_config(out, steps=4, ckpt_every=2, resume=True, weight_decay=0.0, beta1=0.5))
    assert resumed["losses"] == full["losses"][2:]
    logged = capsys.readouterr().out
    assert "optimizer settings are kept: weight_decay 0.1, betas (0.9, 0.95) (not this run's)" in logged, logged


def test_resume_refuses_other_settings(tmp_path):
    out = tmp_path / "run"
    train.train(small_config(out, steps=3))
    with pytest.raises(ConfigError, match="batch_size 8 -> 16"):
        train.train(small_config(out, steps=3, batch_size=16, resume=True))
    with pytest.raises(ConfigError, match="schedule"):
        train.train(small_config(out, steps=5, resume=True))


def test_resume_without_a_run_is_refused_and_overwrite_clears_old_ones(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="holds no run"):  # a typo in --out must not silently start over
        train.train(small_config(out, steps=3, resume=True))
    summary = train.train(small_config(out, steps=3))
    assert summary["steps"] == [0, 1, 2] and summary["resumed_from"] is None
    assert checkpoint.latest_step(out / "checkpoints") == 3
    # --overwrite replaces the run: it must not leave the old latest behind for a later --resume
    train.train(small_config(out, steps=2, ckpt_every=0, overwrite=True))
    assert checkpoint.latest_step(out / "checkpoints") is None
    assert [r["step"] for r in records(out)] == [0, 1]


def read_rank(root: Path, step: int, rank: int) -> dict:
    """Rank `rank`'s file of the checkpoint at `step`, verified against meta.json as the trainer reads it."""
    path = root / checkpoint.step_dir_name(step) / checkpoint.rank_file(rank)
    return checkpoint.read_rank_file(path, checkpoint.load_meta(root, step)["files"][path.name])


def test_layout_and_atomic_publication(tmp_path):
    root = tmp_path / "checkpoints"
    state = {"w": torch.arange(6.0).reshape(2, 3), "step": 4, "rng": (1, 2, 3)}
    path = checkpoint.save_checkpoint(root, 4, state, {"note": "hi"})
    assert path == root / "step_000004"
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "rank0.pt"]
    assert (root / "latest").read_text().strip() == "step_000004"
    assert not list(root.glob(".tmp*"))
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 4 and meta["world_size"] == 1 and list(meta["files"]) == ["rank0.pt"]
    assert meta["files"]["rank0.pt"] == {"bytes": (path / "rank0.pt").stat().st_size,
                                         "sha256": checkpoint.sha256_file(path / "rank0.pt")}
    assert meta["note"] == "hi"
    loaded = read_rank(root, 4, rank=0)
    assert torch.equal(loaded["w"], state["w"]) and loaded["rng"] == (1, 2, 3) and checkpoint.load_meta(root, 4) == meta

    # A crash mid-save leaves a .tmp directory or one without meta.json: neither counts as a checkpoint.
    (root / ".tmp_step_000009").mkdir()
    (root / "step_000008").mkdir()
    torch.save({}, root / "step_000008" / "rank0.pt")
    assert checkpoint.latest_step(root) == 4
    (root / "latest").unlink()  # without the pointer, the newest complete directory
    assert checkpoint.latest_step(root) == 4


def test_each_rank_writes_its_own_file(tmp_path):
    root = tmp_path / "checkpoints"
    world = 3
    barrier = threading.Barrier(world)
    errors = []

    def rank_main(rank):
        try:
            checkpoint.save_checkpoint(root, 10, {"shard": torch.full((2,), float(rank))}, {"layout": "test"},
                                       rank=rank, world_size=world, barrier=barrier.wait)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors
    assert sorted(p.name for p in (root / "step_000010").iterdir()) == ["meta.json", "rank0.pt", "rank1.pt",
                                                                         "rank2.pt"]
    for rank in range(world):
        assert torch.equal(read_rank(root, 10, rank)["shard"], torch.full((2,), float(rank)))
    # meta.json records each rank's size and SHA-256
    assert sorted(checkpoint.load_meta(root, 10)["files"]) == ["rank0.pt", "rank1.pt", "rank2.pt"]


class _VisibleGpus:
    """torch.cuda's generator calls on a node that shows `count` GPUs, modelled on the CPU: each device's state is
    its own tensor; a device index past what is visible raises as CUDA does."""

    def __init__(self, count: int) -> None:
        self.states = {i: torch.tensor([i], dtype=torch.uint8) for i in range(count)}
        self.touched: list[int] = []

    def _index(self, device) -> int:
        index = torch.device(device).index
        if index >= len(self.states):
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        self.touched.append(index)
        return index

    def get_rng_state(self, device) -> torch.Tensor:
        return self.states[self._index(device)].clone()

    def set_rng_state(self, state, device) -> None:
        self.states[self._index(device)] = state.clone()

    def current_device(self) -> int:
        return 0


def test_cuda_generators_resume_where_fewer_gpus_are_visible():
    """A rank saves its own GPU's generator only (not the 8 visible: that makes a context on each), and puts it back
    on the device it computes on now, here cuda:1 of a 2-GPU node; a checkpoint written before (every visible
    GPU's state) gives the rank its device's."""
    from minidist.train.run_state import rng_state, set_rng_state

    node8 = _VisibleGpus(8)
    node8.states[3] = torch.tensor([42], dtype=torch.uint8)
    saved = rng_state(torch.device("cuda", 3), cuda=node8)
    assert node8.touched == [3] and [int(s) for s in saved["cuda"]] == [42]
    node2 = _VisibleGpus(2)
    set_rng_state(saved, torch.device("cuda", 1), cuda=node2)
    assert node2.touched == [1] and int(node2.states[1]) == 42 and int(node2.states[0]) == 0
    old = {**saved, "cuda": [torch.tensor([i], dtype=torch.uint8) for i in range(8)]}  # every visible GPU's
    set_rng_state(old, torch.device("cuda", 1), cuda=node2)
    assert int(node2.states[1]) == 1
    assert rng_state(torch.device("cpu"), cuda=node8)["cuda"] is None and node8.touched == [3]
    set_rng_state(saved, torch.device("cpu"), cuda=node2)  # a CPU run touches no GPU
    assert node2.touched == [1, 1]
