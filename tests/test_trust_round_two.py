"""Trust nothing, round two (issue #30): a run directory that cannot be turned against its user, a checkpoint index
under its own checksum, a validation set that does not depend on --microbatches, and one line for every bad input.

Single-process runs of tests/test_checkpoint.py's 2-layer model (one base run, copied per test), and one launch of
2 ranks for the errors that only one rank sees.
"""

import contextlib
import functools
import io
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_checkpoint import small_config
from test_trust import (  # noqa: F401 - cli is a fixture
    Payload,
    base_run,  # noqa: F401  (the fixture: 4 steps, checkpoints after steps 2 and 4)
    cli,
)

from minidist import out_files
from minidist.comm import communicator
from minidist.comm.launch import run_ranks
from minidist.comm.recorder import FlightRecorder
from minidist.convert import hf_files
from minidist.convert.hf_model import to_hf_state
from minidist.convert.runs import read_hf
from minidist.data.corpus import load_corpus
from minidist.debug.diff import FlightError
from minidist.debug.diff import load as load_flight
from minidist.model import build_model, get_preset
from minidist.out_files import LinkRefused
from minidist.train import checkpoint, metrics, reshard, run_dir
from minidist.train import loop as train
from minidist.train.config import ConfigError, parse_config
from minidist.train.plots import plot_losses
from minidist.trust import health


@pytest.fixture
def run(base_run, tmp_path, one_thread) -> Path:  # noqa: F811  (base_run: test_trust's fixture)
    out = tmp_path / "run"
    shutil.copytree(base_run, out, symlinks=True)
    return out


def refusal(out: Path, **changes) -> str:
    with pytest.raises(ConfigError) as info:
        train.train(small_config(out, steps=4, ckpt_every=2, **changes))
    assert "\n" not in str(info.value)
    return str(info.value)


def victim(tmp_path: Path) -> Path:
    """A file outside OUT that a planted link points to: it must never change."""
    path = tmp_path / "important.txt"
    path.write_text("the user's precious file")
    return path


# ------------------------------------------------------------------------------------------------------------------
# OUT: nothing outside it written or deleted, only the trainer's files replaced, one process at a time


def test_links_in_out_are_never_written_through(run, tmp_path):
    precious = victim(tmp_path)
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "loss.png").symlink_to(precious)  # `ln -s ~/important OUT/loss.png`
    assert "loss.png" in refusal(fresh, plot=True)
    (run / "run.json").unlink()
    (run / "run.json").symlink_to(precious)  # a received run directory, resumed
    assert "run.json is a symbolic link" in refusal(run, resume=True)
    assert precious.read_text() == "the user's precious file"

    # Below the checks too: whole files replace a link, appends refuse one, plots replace one.
    link = tmp_path / "link"
    link.symlink_to(precious)
    out_files.replace_file(link, b"new")
    assert not link.is_symlink() and link.read_bytes() == b"new"
    link.unlink()
    link.symlink_to(precious)
    with pytest.raises(OSError):
        metrics.MetricsWriter(link).write({"step": 0})
    plot_losses([{"step": 0, "loss": 5.0}], link)
    assert not link.is_symlink() and precious.read_text() == "the user's precious file"


def test_a_linked_step_directory_is_neither_loaded_nor_pruned(run, tmp_path):
    root = run / "checkpoints"
    shutil.move(root / "step_000002", tmp_path / "elsewhere")
    (root / "step_000002").symlink_to(tmp_path / "elsewhere")
    assert checkpoint.complete_steps(root) == [4]
    assert checkpoint.prune_checkpoints(root, keep=1) == [] and (tmp_path / "elsewhere" / "meta.json").is_file()


def test_only_overwrite_replaces_a_users_plot_and_never_a_foreign_file(run, tmp_path):
    out = tmp_path / "plot_only"
    out.mkdir()
    (out / "loss.png").write_bytes(b"my own figure")  # no run markers: still someone's file
    assert "holds loss.png but no run" in refusal(out)
    assert (out / "loss.png").read_bytes() == b"my own figure"

    (run / "checkpoints" / "my_model.bin").write_bytes(b"weights I trained elsewhere")
    message = refusal(run, overwrite=True)
    assert "my_model.bin" in message and "did not write" in message
    assert (run / "checkpoints" / "my_model.bin").is_file() and (run / "checkpoints" / "step_000004").is_dir()
    (run / "checkpoints" / "my_model.bin").unlink()
    (run / "flight").mkdir()
    (run / "flight" / "notes.txt").write_text("mine")
    assert "notes.txt" in refusal(run, overwrite=True)


def test_a_live_lock_refuses_a_second_run_and_a_stale_one_is_taken_over(run, tmp_path, capsys):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run / ".lock").write_text(f"{live.pid} {socket.gethostname()}\n")
        message = refusal(run, resume=True)
        assert f"in use by process {live.pid}" in message and ".lock" in message
    finally:
        live.kill()
        live.wait()
    (run / ".lock").write_text(f"{live.pid} {socket.gethostname()}\n")  # its process is gone now
    summary = train.train(small_config(run, steps=4, ckpt_every=2, resume=True))
    assert summary["resumed_from"] == 4 and "taking it over" in capsys.readouterr().out
    assert not (run / ".lock").exists()  # released at the end


def test_a_tilde_in_out_is_expanded_once_for_checks_and_writes():
    assert parse_config(["--out", "~/runs/x"]).out == os.path.expanduser("~/runs/x")


# ------------------------------------------------------------------------------------------------------------------
# the checkpoint's index under its own checksum


def test_a_flipped_bit_in_the_index_is_refused(run):
    path = run / "checkpoints" / "step_000004" / "meta.json"
    meta = json.loads(path.read_text())
    meta["pieces"][1]["position"], meta["pieces"][2]["position"] = (meta["pieces"][2]["position"],
                                                                    meta["pieces"][1]["position"])
    path.write_text(json.dumps(meta, indent=2))  # two tensors swapped: every count still fits
    assert "does not match its own SHA-256" in refusal(run, resume=True)
    with pytest.raises(ValueError, match="does not match its own SHA-256"):
        reshard.read_full_model(path.parent)


def test_index_entries_naming_one_piece_twice_or_overlapping_are_refused(run):
    step_dir = run / "checkpoints" / "step_000004"
    meta = json.loads((step_dir / "meta.json").read_text())
    twice = {**meta, "pieces": [*meta["pieces"], dict(meta["pieces"][0])]}
    with pytest.raises(ValueError, match="lists piece 0 of rank0.pt twice"):
        reshard.PieceReader(step_dir, twice)
    # Two pieces of one tensor covering the same half, the other half missing: the count alone passes.
    name, full = meta["pieces"][0]["name"], meta["pieces"][0]["shape"]
    numel = int(torch.tensor(full).prod())
    halves = [{**meta["pieces"][0], "runs": [[0, numel // 2, 1, 0]]},
              {**meta["pieces"][0], "position": len(meta["pieces"]), "runs": [[0, numel - numel // 2, 1, 0]]}]
    state = torch.load(step_dir / "rank0.pt", weights_only=True)
    first = state["pieces"][0]
    state["pieces"].append({k: v[: numel - numel // 2] if v.dim() else v for k, v in first.items()})
    state["pieces"][0] = {k: v[: numel // 2] if v.dim() else v for k, v in first.items()}
    torch.save(state, step_dir / "rank0.pt")
    data = (step_dir / "rank0.pt").read_bytes()
    meta["files"]["rank0.pt"] = {"bytes": len(data), "sha256": checkpoint.sha256_file(step_dir / "rank0.pt")}
    meta["pieces"] = [p for p in meta["pieces"] if p["name"] != name] + halves
    (step_dir / "meta.json").write_text(json.dumps(checkpoint.seal_meta(meta)))
    with pytest.raises(ValueError, match="some twice: each must be written exactly once"):
        reshard.read_full_model(step_dir)


@pytest.mark.parametrize("content, words", [
    ("[" * 100_000 + "]" * 100_000, "not readable JSON (RecursionError)"),
    (None, "does not list one file per rank"),  # world_size 10**9, refused without building 10**9 names
])
def test_hostile_meta_json_is_one_line_and_quick(run, content, words):
    path = run / "checkpoints" / "step_000004" / "meta.json"
    if content is None:
        meta = json.loads(path.read_text())
        content = json.dumps(checkpoint.seal_meta({**meta, "world_size": 10**9}))
    path.write_text(content)
    started = time.perf_counter()
    assert words in refusal(run, resume=True)
    assert time.perf_counter() - started < 30


# ------------------------------------------------------------------------------------------------------------------
# the validation set does not depend on --microbatches


def test_validation_loss_is_the_same_for_any_number_of_micro_batches(tmp_path, one_thread):
    losses = [train.train(small_config(tmp_path / f"mb{m}", microbatches=m, steps=2, eval_every=2, ckpt_every=0,
                                       eval_batches=2))["val_losses"] for m in (1, 2)]
    assert losses[0].keys() == losses[1].keys() == {1}
    assert abs(losses[0][1] - losses[1][1]) < 1e-5, losses  # 5.47768 against 5.46089 before: other rows


# ------------------------------------------------------------------------------------------------------------------
# one line for every bad input


@pytest.mark.parametrize("argv, words", [
    (["--beta1", "2"], "beta1 must be in [0, 1)"),
    (["--beta2", "-0.5"], "beta2 must be in [0, 1)"),
    (["--comm-timeout", "1e300"], "--comm-timeout must be between 1 and 604800"),
    (["--comm-timeout", "1e-9"], "--comm-timeout must be between 1"),
    (["--peak-flops", "-5"], "peak_flops must be > 0"),
    (["--peak-flops", "0"], "peak_flops must be > 0"),
    (["--seed", str(2**70)], "seed must be in [0, 2**63)"),
    (["--inject-fault", "bitflip:\u00b2:1"], "is not bitflip:STEP:RANK"),
    (["--set", "model.n_layers=10000000"], "GiB per rank (model states"),
    (["--set", "model.d_model=1000000000", "--set", "model.n_heads=1", "--set", "model.n_kv_heads=1"], "GiB per rank"),
    (["--set", "model.vocab_size=10000000000"], "GiB per rank (model states"),
    (["--batch-size", "1000000000"], "GiB per rank"),
    (["--eval-batches", "1000000000"], "GiB per rank (validation batches"),
    (["--data", "/dev/zero"], "not a regular file or a directory"),
])
def test_bad_input_is_one_line_before_anything_is_built(cli, tmp_path, argv, words):  # noqa: F811
    started = time.perf_counter()
    assert words in cli([*argv, "--out", str(tmp_path / "run")])
    assert time.perf_counter() - started < 20


def test_a_fifo_as_data_is_one_line(cli, tmp_path):  # noqa: F811
    os.mkfifo(tmp_path / "pipe")
    assert "not a regular file" in cli(["--data", str(tmp_path / "pipe"), "--out", str(tmp_path / "run")])
    with pytest.raises(ValueError, match="not a regular file"):
        load_corpus(str(tmp_path / "pipe"))


def test_a_bad_fault_name_leaves_no_run_behind(tmp_path, one_thread):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="has no parameter 'no.such.weight'"):
        train.train(small_config(out, steps=2, inject_fault="bitflip:1:0:no.such.weight"))
    assert not any((out / name).exists() for name in run_dir.RUN_FILES)


def test_a_non_utf8_file_name_is_named(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "good.txt").write_text("hello world " * 100)
    with open(os.path.join(os.fsencode(folder), b"bad\xff.txt"), "wb") as f:
        f.write(b"some text " * 100)
    with pytest.raises(ValueError, match=r"bad\\xff.txt.*not UTF-8"):
        load_corpus(str(folder))


def test_hostile_hf_and_flight_files_are_one_line(tmp_path):
    # A shard index naming a link that points outside the checkpoint directory.
    hf = tmp_path / "hf"
    hf.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    (hf / "model-1.safetensors").symlink_to(tmp_path / "outside.safetensors")
    (hf / "index.json").write_text(json.dumps({"weight_map": {"w": "model-1.safetensors"}}))
    with pytest.raises(hf_files.ConvertError, match="outside"):
        hf_files._shard_files(hf / "index.json", "safetensors")
    (hf / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(hf_files.ConvertError, match="not valid JSON"):
        hf_files._read_json(hf / "deep.json", 10**7)
    # A pickle refused without passing on torch's advice to load it unsafely.
    (hf / "pytorch_model.bin").write_bytes(pickle.dumps(Payload(tmp_path / "ran")))
    with pytest.raises(hf_files.ConvertError) as info:
        hf_files._read_torch(hf / "pytorch_model.bin")
    assert "weights_only=False" not in str(info.value) and "objects other than tensors" in str(info.value)
    assert not (tmp_path / "ran").exists()
    # Flight records: a FIFO (a read would block forever) and a record nested too deep.
    flight = tmp_path / "out" / "flight"
    flight.mkdir(parents=True)
    os.mkfifo(flight / "rank0.json")
    with pytest.raises(FlightError, match="not a regular file"):
        load_flight(tmp_path / "out")
    (flight / "rank0.json").unlink()
    (flight / "rank0.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(FlightError, match="RecursionError"):
        load_flight(tmp_path / "out")
    # ...and the recorder never writes its record through a link.
    precious = victim(tmp_path)
    (flight / "rank0.json").unlink()
    (flight / "rank0.json").symlink_to(precious)
    FlightRecorder(0).write(flight / "rank0.json", "test")  # the link is replaced, not followed
    assert precious.read_text() == "the user's precious file" and not (flight / "rank0.json").is_symlink()
    assert json.loads((flight / "rank0.json").read_text())["reason"] == "test"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "linked").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(LinkRefused):  # a run directory that is a link is refused, as the trainer's own files are
        FlightRecorder(0).write(tmp_path / "linked" / "rank0.json", "test")
    assert not any(elsewhere.iterdir())


# ------------------------------------------------------------------------------------------------------------------
# errors that one rank alone sees, and asynchronous waits, are named


def _rank_errors(root: str) -> tuple[int, str]:
    """train.main on this rank with a fault whose parameter only rank 1 would look for: its stderr."""
    err = io.StringIO()
    argv = ["--steps", "2", "--batch-size", "4", "--seq-len", "16", "--max-bytes", "50000", "--set", "model.n_layers=1",
            "--set", "model.d_model=32", "--set", "model.n_heads=2", "--set", "model.n_kv_heads=1", "--set",
            "model.d_ff=64", "--no-plot", "--peak-flops", "1e9", "--comm-timeout", "5", "--ckpt-timeout", "5",
            "--eval-every", "0", "--inject-fault", "bitflip:1:1:no.such.weight", "--out", f"{root}/run"]
    with contextlib.redirect_stderr(err):
        code = train.main(argv)
    return code, err.getvalue()


def test_an_error_found_by_one_rank_is_printed_by_that_rank(tmp_path):
    results = run_ranks(_rank_errors, 2, str(tmp_path), timeout=120, threads_per_rank=1)
    code, err = results[1]
    assert code == 2 and err.startswith("error: rank 1: --inject-fault") and "no.such.weight" in err, results
    assert results[0][0] != 0


def test_a_failed_asynchronous_wait_names_its_group_and_op():
    class Failing:  # a Work whose wait() fails in C, as gloo's does (no Python frame below Handle.wait)
        wait = staticmethod(functools.partial(int, "Connection closed by peer"))

    comm = communicator.Comm(None)
    handle = communicator.Handle(Failing(), None, origin=(comm, "all_gather", None))
    try:
        handle.wait()
    except ValueError as e:
        line = health.comm_failure(e)
    assert line.startswith(f"waiting for all_gather over group {comm.name}") and "Connection closed" in line, line


# ------------------------------------------------------------------------------------------------------------------
# full disks and unwritable places


def test_a_full_disk_during_a_checkpoint_is_one_line_and_keeps_latest(tmp_path, monkeypatch, capsys, one_thread):
    real_save, calls = torch.save, []

    def disk_full_after_one(*args, **kwargs):  # the checkpoint at step 2 is written, the one at step 4 is not
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4352 vs 4244")
        return real_save(*args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full_after_one)
    argv = ["--set", "model.n_layers=1", "--set", "model.d_model=32", "--set", "model.n_heads=2", "--set",
            "model.n_kv_heads=1", "--set", "model.d_ff=64", "--max-bytes", "50000", "--batch-size", "4",
            "--seq-len", "16", "--steps", "4", "--eval-every", "0", "--ckpt-every", "2", "--peak-flops", "1e9",
            "--no-plot", "--out", str(tmp_path / "run")]
    assert train.main(argv) == 1
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "unexpected pos" in err and "previous checkpoint is intact" in err, err
    assert checkpoint.latest_step(tmp_path / "run" / "checkpoints") == 2


def test_to_hf_into_an_unwritable_place_is_one_line(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(hf_files.ConvertError, match="is a file"):
        hf_files.check_new_dir(a_file / "hf")
    with pytest.raises(hf_files.ConvertError, match="cannot write"):  # the write itself fails (here: under a file)
        _write_without_check(a_file / "hf")


def _write_without_check(hf_dir: Path) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_files, "check_new_dir", lambda path: None)
        hf_files.write_hf_dir(hf_dir, {}, {"w": torch.zeros(2)})


# ------------------------------------------------------------------------------------------------------------------
# debug diff names a live rank stuck outside communication


def test_diff_names_a_live_rank_that_waits_in_no_call():
    recorder = FlightRecorder(0)
    comm = communicator.Comm(None)
    seen = []

    class Work:  # seen from inside the wait: the record says which call this rank is blocked in
        def wait(self):
            seen.append(recorder.waiting_on)

    rec_seq = recorder.record("dp", (0, 1), "all_reduce", (4,), torch.float32, detail="sum")
    comm.recorder = recorder
    communicator.Handle(Work(), None, origin=(comm, "all_reduce", rec_seq)).wait()
    assert seen == [rec_seq] and recorder.waiting_on is None

    from minidist.debug.diff import diff, report
    dumps = {}
    for rank, waiting in ((0, 0), (1, None)):  # the same calls; rank 0 blocked in its all_reduce, rank 1 in none
        r = FlightRecorder(rank)
        r.record("dp", (0, 1), "all_reduce", (4,), torch.float32, detail="sum")
        r.waiting_on = waiting
        dumps[rank] = json.loads(json.dumps(r.snapshot("signal SIGTERM")))
    findings = diff(dumps)
    assert [(f.kind, f.rank) for f in findings] == [("outside", 1)], findings
    assert "rank 1 is blocked in no call while rank 0 waits for it in all_reduce" in report(dumps, findings)


def test_a_failed_collective_names_its_call_site():
    class Failing:
        wait = staticmethod(functools.partial(int, "Timed out waiting 10000ms"))

    recorder = FlightRecorder(0)
    comm = communicator.Comm(None)
    comm.recorder = recorder
    seq = recorder.record(comm.name, (0, 1), "all_gather", (1,), torch.int64)  # recorded here, in this test
    comm.last_call = ("all_gather", seq)
    try:
        communicator.Handle(Failing(), None, origin=(comm, "all_gather", seq)).wait()
    except ValueError as e:
        line = health.comm_failure(e)
    assert "posted at" in line and "test_trust_round_two.py" in line and "Timed out" in line, line


def test_an_hf_checkpoint_that_would_not_fit_is_one_line_before_any_tensor(tmp_path):
    cfg = get_preset("tiny", n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, d_ff=32)
    hf_config, hf_state = to_hf_state(cfg, build_model(cfg).state_dict())
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps({**hf_config, "vocab_size": 2**40}))
    with pytest.raises(hf_files.ConvertError, match="no trained model is that large"):  # past the parser's caps
        read_hf(huge)
    # Inside every cap, but 2^24 x 2^18 embedding rows of fp32: more memory than any machine has.
    wide = {"vocab_size": 1 << 24, "hidden_size": 1 << 18, "head_dim": (1 << 18) // hf_config["num_attention_heads"]}
    (huge / "config.json").write_text(json.dumps({**hf_config, **wide}))
    with pytest.raises(hf_files.ConvertError, match="GiB to convert"):
        read_hf(huge)
    # A 41 KB file whose embedding is one stored row repeated (stride 0): refused before a copy expands it.
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "config.json").write_text(json.dumps(hf_config))
    name = next(n for n in hf_state if "embed" in n)
    torch.save({**hf_state, name: hf_state[name][:1].clone().expand_as(hf_state[name])}, flat / "pytorch_model.bin")
    with pytest.raises(hf_files.ConvertError, match="stride-0"):
        read_hf(flat)


def test_max_bytes_reads_only_what_it_keeps(tmp_path):
    import tracemalloc

    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # 512 MiB, sparse: no disk used
        f.truncate(512 << 20)
    tracemalloc.start()
    try:
        corpus = load_corpus(str(big), 0.05, max_bytes=10_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert corpus.train.numel() + corpus.val.numel() == 10_000 and peak < 16 << 20, peak  # not 512 MiB read first
