"""Trust nothing: checkpoints are loaded as data, never as code, and checked byte for byte; a run in OUT is never
destroyed unless --overwrite says so; every bad input is one line (exit code 2) before anything is built.

Single-process runs of the 2-layer model of tests/test_checkpoint.py; one base run is copied for each test.
"""

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from test_checkpoint import records, small_config

from minidist.train import checkpoint, run_dir
from minidist.train import loop as train
from minidist.train.config import ConfigError


class Payload:
    """What an attacker plants: unpickling it calls open(marker, "w"), which creates the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


@pytest.fixture(scope="module")
def base_run(tmp_path_factory) -> Path:
    """4 steps with checkpoints after steps 2 and 4 (latest: 4)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("base") / "run"
        train.train(small_config(out, steps=4, ckpt_every=2))
        return out
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def run(base_run, tmp_path, one_thread) -> Path:
    out = tmp_path / "run"
    shutil.copytree(base_run, out)
    return out


def resume(out: Path, **changes) -> dict:
    return train.train(small_config(out, steps=4, ckpt_every=2, resume=True, **changes))


def refusal(out: Path, **changes) -> str:
    """The one-line ConfigError of a run into `out`."""
    with pytest.raises(ConfigError) as info:
        train.train(small_config(out, steps=4, ckpt_every=2, **changes))
    message = str(info.value)
    assert "\n" not in message
    return message


def record_checksum(step_dir: Path, name: str) -> None:
    """What an attacker who can write the files does too: make the size and SHA-256 in meta.json match (and
    meta.json's own SHA-256)."""
    meta = json.loads((step_dir / "meta.json").read_text())
    data = (step_dir / name).read_bytes()
    if isinstance(meta["files"], dict):  # a checkpoint format without checksums has none to update
        meta["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step_dir / "meta.json").write_text(json.dumps(checkpoint.seal_meta(meta)))


# ------------------------------------------------------------------------------------------------------------------
# safe loading and verified checkpoints


@pytest.mark.parametrize("target", ["rank0.pt", "rank0.pt as a raw pickle", "meta.json", "latest"])
def test_planted_pickle_never_runs(run, tmp_path, target):
    marker = tmp_path / "payload_ran"
    step_dir = run / "checkpoints" / "step_000004"
    name = target.split()[0]
    if target == "rank0.pt":  # a real torch.save file, the payload inside the state
        torch.save({"model": Payload(marker), "schedule": {}}, step_dir / name)
        record_checksum(step_dir, name)
    elif target == "rank0.pt as a raw pickle":
        (step_dir / name).write_bytes(pickle.dumps(Payload(marker), protocol=2))  # torch.load's own protocol
        record_checksum(step_dir, name)
    else:
        path = run / "checkpoints" / "latest" if name == "latest" else step_dir / name
        path.write_bytes(pickle.dumps(Payload(marker)))
    pickle.loads(pickle.dumps(Payload(tmp_path / "control"))).close()  # the payload does run when unpickled
    assert (tmp_path / "control").exists()

    message = refusal(run, resume=True)
    assert not marker.exists(), "the planted payload ran"
    assert name in message, message


@pytest.mark.parametrize("damage, words", [
    ("truncated", "bytes, meta.json records"),
    ("one bit flipped", "does not match the SHA-256"),
    ("missing", "is missing"),
])
def test_damaged_rank_file_is_one_line_naming_it(run, damage, words):
    path = run / "checkpoints" / "step_000004" / "rank0.pt"
    data = bytearray(path.read_bytes())
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "one bit flipped":
        data[len(data) // 2] ^= 0x01
        path.write_bytes(data)
    else:
        path.unlink()
    message = refusal(run, resume=True)
    assert str(path) in message and words in message, message


@pytest.mark.parametrize("change, words", [
    (lambda state: state.pop("run"), "does not fit this run: KeyError 'run'"),
    (lambda state: state["run"]["param_groups"]["decay"].update(betas="fast"), "betas='fast' does not fit"),
    (lambda state: state["run"]["param_groups"]["decay"].update(eps=float("nan")), "eps=nan does not fit"),
    (lambda state: state["run"]["param_groups"].pop("no_decay"), "settings of param group no_decay"),
    (lambda state: state["pieces"].pop(), "does not hold the value of piece"),
])
def test_rank_file_of_other_contents_is_one_line(run, change, words):
    """Tensors and plain data with valid checksums, but not what a run's checkpoint holds."""
    step_dir = run / "checkpoints" / "step_000004"
    state = torch.load(step_dir / "rank0.pt", weights_only=True)
    change(state)
    torch.save(state, step_dir / "rank0.pt")
    record_checksum(step_dir, "rank0.pt")
    message = refusal(run, resume=True)
    assert words in message, message


def test_checkpoint_of_an_older_format_is_one_line(run):
    path = run / "checkpoints" / "step_000004" / "meta.json"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, "format": checkpoint.FORMAT_VERSION - 1}))
    message = refusal(run, resume=True)
    assert f"has format {checkpoint.FORMAT_VERSION - 1}, this code reads {checkpoint.FORMAT_VERSION}" in message


def test_save_fsyncs_each_file_and_directory_before_publishing(tmp_path, monkeypatch):
    events = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                 real_fsync(fd)))
    monkeypatch.setattr(os, "rename", lambda a, b: (events.append(("rename", str(a))), real_rename(a, b)))
    monkeypatch.setattr(os, "replace", lambda a, b: (events.append(("replace", str(a))), real_replace(a, b)))
    root = tmp_path.resolve() / "checkpoints"  # as /proc/self/fd names it
    checkpoint.save_checkpoint(root, 4, {"w": torch.ones(3)}, {})

    def at(event: tuple) -> int:
        return events.index(event)

    tmp = str(root / ".tmp_step_000004")
    publish = at(("rename", tmp))
    for path in (f"{tmp}/rank0.pt", f"{tmp}/meta.json", tmp):
        assert at(("fsync", path)) < publish, (path, events)
    assert ("fsync", str(root)) in events[publish + 1:]  # the rename itself made durable
    latest_tmp = next(path for kind, path in events if kind == "replace" and Path(path).name.startswith(".latest."))
    assert at(("fsync", latest_tmp)) < at(("replace", latest_tmp)) < len(events) - 1
    assert events[-1] == ("fsync", str(root))


def test_keep_prunes_old_checkpoints_but_never_the_latest(tmp_path, one_thread):
    out = tmp_path / "run"
    train.train(small_config(out, steps=5, ckpt_every=1, keep=2))
    assert checkpoint.complete_steps(out / "checkpoints") == [4, 5]

    root = tmp_path / "checkpoints"
    for step in (1, 2, 3):
        checkpoint.save_checkpoint(root, step, {"w": torch.full((2,), float(step))}, {})
    (root / "latest").write_text("step_000001\n")  # e.g. rolled back by hand to resume from step 1
    assert checkpoint.prune_checkpoints(root, keep=1) == [2]
    assert checkpoint.complete_steps(root) == [1, 3]


# ------------------------------------------------------------------------------------------------------------------
# never destroy a run


def test_new_run_into_an_out_holding_a_run_is_refused_and_changes_nothing(run, tmp_path):
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    message = refusal(run)
    assert "already holds a run" in message and "--resume" in message and "--overwrite" in message
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before

    for marker in run_dir.RUN_MARKERS:  # any one of them is a run
        out = tmp_path / f"only_{marker}"
        out.mkdir()
        (shutil.copytree if (run / marker).is_dir() else shutil.copy)(run / marker, out / marker)
        assert f"({marker})" in refusal(out)


def test_resume_without_a_checkpoint_keeps_the_runs_metrics(run):
    shutil.rmtree(run / "checkpoints")  # a run with --ckpt-every 0: metrics.jsonl and run.json only
    metrics = (run / "metrics.jsonl").read_bytes()
    assert "holds no checkpoint" in refusal(run, resume=True)
    assert (run / "metrics.jsonl").read_bytes() == metrics


def test_overwrite_removes_only_the_trainers_files(run, tmp_path):
    elsewhere = tmp_path / "elsewhere"  # checkpoints/ as a symlink: overwrite must not follow it
    shutil.move(run / "checkpoints", elsewhere)
    (run / "checkpoints").symlink_to(elsewhere)
    (run / "loss.png").write_bytes(b"old plot")
    (run / "flight").mkdir()  # a failed run's flight records
    (run / "flight" / "rank1.json").write_text("{}")
    (run / "notes.txt").write_text("keep me")
    (run / "data").mkdir()
    (run / "data" / "corpus.txt").write_text("mine")

    summary = train.train(small_config(run, steps=2, ckpt_every=0, overwrite=True))
    assert summary["steps"] == [0, 1] and [r["step"] for r in records(run)] == [0, 1]
    assert sorted(p.name for p in run.iterdir()) == ["data", "metrics.jsonl", "notes.txt", "run.json", "tokenizer.json"]
    assert (run / "notes.txt").read_text() == "keep me" and (run / "data" / "corpus.txt").read_text() == "mine"
    assert checkpoint.complete_steps(elsewhere) == [2, 4]  # the symlink went, not what it pointed to


def test_resume_drops_a_metrics_line_torn_by_a_crash(run):
    # The run died during step 4 (index 3), mid-way through writing its record; its last checkpoint is step 2.
    shutil.rmtree(run / "checkpoints" / "step_000004")
    (run / "checkpoints" / "latest").write_text("step_000002\n")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])
    summary = resume(run)
    assert summary["resumed_from"] == 2 and summary["steps"] == [2, 3]
    assert [r["step"] for r in records(run)] == [0, 1, 2, 3]


# ------------------------------------------------------------------------------------------------------------------
# one line for every bad input, before anything is built


@pytest.fixture
def cli(monkeypatch, capsys):
    """train.main in this process; fails the test if it gets as far as the process group or the model."""
    def built(*args, **kwargs):
        raise AssertionError("the run was built before its input was checked")

    monkeypatch.setattr(train, "joined", built)
    monkeypatch.setattr(train, "setup", built)

    def main(argv: list[str]) -> str:
        code = train.main(argv)
        err = capsys.readouterr().err
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), (code, err)
        return err

    return main


def unwritable_dir(tmp_path: Path) -> Path:
    if os.geteuid() == 0:  # root writes through any permission bits; sysfs refuses new files even to root
        return Path("/sys")
    path = tmp_path / "read_only"
    path.mkdir()
    path.chmod(0o555)
    return path


def test_bad_out_is_one_line(cli, tmp_path):
    file = tmp_path / "a_file"
    file.write_text("not a directory")
    assert "is a file" in cli(["--out", str(file)])
    assert f"{file} is a file" in cli(["--out", str(file / "run")])
    locked = unwritable_dir(tmp_path)
    assert f"cannot write in {locked}" in cli(["--out", str(locked / "run")])
    assert f"cannot write in {locked}" in cli(["--out", str(locked)])


def test_bad_config_file_is_one_line(cli, tmp_path):
    assert "not a regular file" in cli(["--config", str(tmp_path)])  # a directory
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)))
    assert "not UTF-8 text" in cli(["--config", str(binary)])
    broken = tmp_path / "broken.toml"
    broken.write_text("steps = = 3\n")
    assert "not valid TOML" in cli(["--config", str(broken)])


@pytest.mark.parametrize("argv, words", [
    (["--set", "model.n_layers=2.0"], "model.n_layers must be int, got 2.0"),
    (["--set", "model.moe=3"], "model.moe must be a table"),
    (["--set", "model.moe.top_k=1.5"], "model.moe.top_k must be int, got 1.5"),
    (["--lr", "nan"], "lr=nan"),
    (["--set", "lr=inf"], "lr=inf"),
    (["--set", "model.rope_base=-inf"], "model.rope_base=-inf"),
    (["--resume", "--overwrite"], "give one of them"),
    (["--keep", "0"], "keep must be >= 1"),
])
def test_bad_setting_is_one_line(cli, tmp_path, argv, words):
    assert words in cli([*argv, "--out", str(tmp_path / "run")])
