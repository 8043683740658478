"""Trust nothing, round three (issue #45): data checked against the model and against itself, no input that can take
all memory, nothing written through a link planted after a command started.

Huge inputs are sparse files (os.truncate: no disk used), each read in a subprocess whose address space is capped
(RLIMIT_AS), so that a regression is a MemoryError there, never the CI machine's memory.
"""

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_trust import cli  # noqa: F401 - a fixture
from tokenizers import Tokenizer, models

from minidist.convert import hf_files, hf_tokenizer
from minidist.convert.hf_model import ConvertError, to_hf_state
from minidist.convert.runs import main as convert_main
from minidist.data import dataset, prepare, tokenizer
from minidist.data.__main__ import main as data_main
from minidist.model import build_model, get_preset
from minidist.train import loop as train

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
TEXT = "the quick brown fox jumps over the lazy dog; parity keeps distributed training honest.\n" * 300


def limited(code: str, limit_bytes: int, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -c code` with its address space capped at `limit_bytes` (torch imports in well under 2 GiB)."""
    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))
    return subprocess.run([sys.executable, "-c", code], preexec_fn=cap, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                          cwd=ROOT)


def sparse(path: Path, size: int, head: bytes = b"") -> Path:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


@pytest.fixture
def made(tmp_path) -> Path:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text(TEXT)
    prepare.prepare(str(tmp_path / "src"), "bytes", tmp_path / "ds", val_fraction=0.2, shard_tokens=4000,
                    progress=False)
    return tmp_path / "ds"


def rewrite_shard(root: Path, name: str, change) -> None:
    """Change a shard's tokens and record its new SHA-256 in the manifest (a dataset that hashes fine)."""
    path = root / name
    dtype = np.dtype(json.loads((root / "manifest.json").read_text())["dtype"]).newbyteorder("<")
    ids = np.fromfile(path, dtype=dtype)
    change(ids)
    path.write_bytes(ids.tobytes())
    m = json.loads((root / "manifest.json").read_text())
    for split in m["splits"].values():
        for shard in split["shards"]:
            if shard["file"] == name:
                shard["sha256"] = dataset.sha256_bounded(path, path.stat().st_size)
    (root / "manifest.json").write_text(json.dumps(m))


def one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


# ------------------------------------------------------------------------------------------------------------------
# data checked against the model


@pytest.mark.parametrize("case", ["missing", "fifo"])
def test_a_dataset_without_a_readable_manifest_is_refused(cli, made, case):  # noqa: F811
    (made / "manifest.json").unlink()  # a prepare killed before its last write
    if case == "fifo":
        os.mkfifo(made / "manifest.json")
    err = cli(["--data", str(made), "--out", str(made.parent / "run")])
    words = "but no manifest.json (an interrupted prepare?)" if case == "missing" else "is not a regular file"
    assert words in err, err


def test_token_ids_past_the_vocabulary_are_refused_before_anything_starts(cli, made, capsys):  # noqa: F811
    rewrite_shard(made, "train_00000.bin", lambda ids: ids.__setitem__(5, 300))  # the byte vocabulary is 256
    err = cli(["--data", str(made), "--out", str(made.parent / "run")])
    assert "shard 'train_00000.bin' holds token id 300, outside the vocabulary of 256 (ids 0..255)" in err, err
    assert not (made.parent / "run").exists()  # no run.json, no metrics.jsonl: refused before OUT
    assert data_main(["verify", str(made)]) == 2 and "holds token id 300" in one_line(capsys)
    with pytest.raises(ValueError, match="holds token id 300"):
        dataset.open_dataset(made, verify=False)  # the ids are read even when the hashes are not


def test_prepare_checks_the_ids_it_writes(tmp_path):
    tok = tokenizer.byte_tokenizer()
    writer = prepare._SplitWriter(tmp_path, "train", tok, 100)
    with pytest.raises(ValueError, match="produced id 256, outside its vocabulary of 256"):
        writer.add(np.array([1, 256], dtype=np.uint16), last=False)
    assert not list(tmp_path.iterdir())  # refused before a shard was opened


def test_a_manifest_vocabulary_larger_than_its_tokenizer_is_refused(made):
    m = json.loads((made / "manifest.json").read_text())
    m["vocab_size"] = 1000  # the model would get 744 rows no token ever reaches
    (made / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match="the manifest's vocab_size 1,000 is not the 256 ids of its tokenizer"):
        dataset.open_dataset(made)


def test_a_shard_shortened_while_training_is_one_line(made, capsys):
    ds = dataset.open_dataset(made)
    stream = ds.splits["train"]
    shard = stream.paths[0]
    os.truncate(shard, 10)  # another process cuts it while the run reads
    from minidist.data.shards import ShardChanged
    with pytest.raises(ShardChanged, match="ended at byte 10"):
        stream.read(0, 100)


def _bpe_dataset(tmp_path: Path, name: str, text: str) -> Path:
    (tmp_path / f"{name}_src").mkdir()
    (tmp_path / f"{name}_src" / "t.txt").write_text(text)
    prepare.prepare(str(tmp_path / f"{name}_src"), "bpe:300", tmp_path / name, val_fraction=0.2, progress=False)
    return tmp_path / name


def test_from_hf_refuses_a_tokenizer_that_is_not_the_datas(tmp_path, capsys):
    ours = _bpe_dataset(tmp_path, "ours", TEXT)
    other = _bpe_dataset(tmp_path, "other", "Lorem ipsum dolor sit amet, consectetur adipiscing elit.\n" * 300)
    cfg = get_preset("tiny", n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, d_ff=32, vocab_size=300)
    hf_files.write_hf_dir(tmp_path / "hf", *to_hf_state(cfg, build_model(cfg).state_dict()))
    (tmp_path / "hf" / "tokenizer.json").write_bytes((other / "tokenizer.json").read_bytes())  # same size, not ours
    assert convert_main(["from-hf", str(tmp_path / "hf"), str(tmp_path / "ft"), "--data", str(ours)]) == 2
    err = one_line(capsys)
    assert "tokenizer.json is not the tokenizer of --data" in err and "ids differ" in err, err
    assert not (tmp_path / "ft").exists()
    (tmp_path / "hf" / "tokenizer.json").write_bytes((ours / "tokenizer.json").read_bytes())
    hf_tokenizer.check_data_tokenizer(tmp_path / "hf", str(ours))  # the data's own: accepted


def test_to_hf_checks_the_largest_id_not_the_number_of_tokens(tmp_path):
    vocab = {f"w{i}": i for i in range(511)} | {"far": 5000}  # 512 tokens, one of them id 5000
    run = tmp_path / "run"
    run.mkdir()
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(run / "tokenizer.json"))
    with pytest.raises(ConvertError, match="token ids up to 5,000 but the model's embedding has 512 rows"):
        hf_tokenizer.read_run_tokenizer(run, 512)


# ------------------------------------------------------------------------------------------------------------------
# memory bombs: bounded before anything is allocated


def test_a_16_gb_text_source_is_refused_naming_max_bytes(tmp_path):
    big = sparse(tmp_path / "big.txt", 16 * 10**9, b"text\n" * 100)
    code = ("import sys; from minidist.train import loop; "
            f"sys.exit(loop.main(['--data', {str(big)!r}, '--out', {str(tmp_path / 'run')!r}]))")
    done = limited(code, 3 * GIB)
    assert done.returncode == 2 and done.stderr.splitlines() == [
        f"error: data source {str(big)!r} holds 16,000,000,000 bytes, over the 1,073,741,824 a text source is read "
        "into memory; pass --max-bytes N to train on its head, or prepare it (python -m minidist.data prepare) to "
        "train on all of it from disk"], done.stderr


def test_prepare_cuts_a_file_without_newlines_into_bounded_pieces(tmp_path):
    """1 GiB of one line (sparse) under a 768 MiB address space: listed in pieces of at most 2 x PIECE_BYTES, the
    largest tokenized within the cap (read whole, it would not fit)."""
    big = sparse(tmp_path / "oneline.txt", GIB, b"a" * 10_000)
    code = ("from minidist.data import documents, tokenizer; "
            f"listing = documents.list_pieces({str(big)!r}, 0.0); "
            "p = max(listing.train, key=lambda p: p.end - p.start); "
            "assert p.end - p.start <= 2 * documents.PIECE_BYTES, p; "
            "ids = tokenizer.byte_tokenizer().encode(documents.read_range(p.path, p.start, p.end)); "
            "print(len(listing.train), len(ids))")
    done = limited(code, 768 * 2**20)
    assert done.returncode == 0, done.stderr[-2000:]
    pieces, tokens = map(int, done.stdout.split())
    assert pieces >= GIB // (2 * 4 * 2**20) and 0 < tokens <= 8 * 2**20


def _tokenizer_file(tmp_path: Path, vocab: dict[str, int], normalizer: dict | None = None) -> Path:
    """A WordLevel tokenizer.json with `vocab` written into the JSON (`tokenizers` itself takes ~50 s to build one
    holding an id of 4e9: the test does not)."""
    tok = json.loads(Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")).to_str())
    tok["model"]["vocab"] = vocab
    tok["normalizer"] = normalizer
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(tok))
    return path


@pytest.mark.parametrize("case, words", [
    ("bpe:100000000", "bpe vocabulary 100,000,000 is out of range; a byte-level BPE needs 257 (256 bytes and the "
                      "end-of-document token) to 262,144 ids"),
    ("huge id", "has token id 4,000,000,000; ids must be below 262,144"),
    ("expanding normalizer", "its normalizer makes text more than 32 times longer; refused"),
])
def test_a_tokenizer_that_would_take_all_memory_is_refused_first(tmp_path, case, words):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text(TEXT)
    if case == "bpe:100000000":
        spec = case
    elif case == "huge id":
        spec = str(_tokenizer_file(tmp_path, {"<unk>": 0, "<|endoftext|>": 1, "a": 4_000_000_000}))
    else:  # every character replaced by 5,000
        spec = str(_tokenizer_file(tmp_path, {"<unk>": 0, "<|endoftext|>": 1}, {
            "type": "Replace", "pattern": {"Regex": "."}, "content": "x" * 5000}))
    code = ("import sys; from minidist.data.__main__ import main; "
            f"sys.exit(main(['prepare', {str(tmp_path / 'src')!r}, '--tokenizer', {spec!r}, '--out', "
            f"{str(tmp_path / 'ds')!r}, '--quiet']))")
    done = limited(code, 2 * GIB, timeout=120)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1 and words in done.stderr, done.stderr[-2000:]


# ------------------------------------------------------------------------------------------------------------------
# nothing written through a link planted after the command started


def test_prepare_never_writes_through_a_late_link(tmp_path, monkeypatch):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text(TEXT)
    precious = tmp_path / "precious.txt"
    precious.write_text("the user's file")
    out = tmp_path / "ds"
    resolve = tokenizer.resolve_tokenizer

    def plant(names):
        def resolve_then_plant(*args, **kwargs):  # runs after --out was checked and locked
            for name in names:
                (out / name).symlink_to(precious)
            return resolve(*args, **kwargs)
        return resolve_then_plant

    monkeypatch.setattr(tokenizer, "resolve_tokenizer", plant(["manifest.json", "tokenizer.json"]))
    prepare.prepare(str(tmp_path / "src"), "bytes", out, progress=False)  # whole files replace a link
    assert not (out / "manifest.json").is_symlink() and precious.read_text() == "the user's file"
    dataset.open_dataset(out)

    monkeypatch.setattr(tokenizer, "resolve_tokenizer", plant(["train_00000.bin"]))
    with pytest.raises(ValueError, match="train_00000.bin appeared while prepare was writing") as info:
        prepare.prepare(str(tmp_path / "src"), "bytes", out, overwrite=True, progress=False)
    assert "\n" not in str(info.value) and precious.read_text() == "the user's file"


def test_two_prepares_on_one_out_are_one_line(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text(TEXT)
    out = tmp_path / "ds"
    out.mkdir()  # another prepare, alive, holding the lock as the trainer's runs hold theirs: "PID HOST"
    code = (f"import os, socket, time; lock = open({str(out / '.lock')!r}, 'w'); "
            "lock.write(f'{os.getpid()} {socket.gethostname()}\\n'); lock.close(); print('held', flush=True); "
            "time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert data_main(["prepare", str(tmp_path / "src"), "--out", str(out), "--quiet"]) == 2
        assert f"is in use by process {holder.pid}" in one_line(capsys)
        assert [p.name for p in out.iterdir()] == [".lock"]  # the other's dataset untouched
    finally:
        holder.kill()
        holder.wait()
    assert data_main(["prepare", str(tmp_path / "src"), "--out", str(out), "--quiet"]) == 0  # its lock was stale
    capsys.readouterr()


def test_a_late_link_at_out_tensorboard_is_never_followed(tmp_path, monkeypatch, capsys, one_thread):
    pytest.importorskip("tensorboard")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "run"
    setup = train.setup

    def setup_then_plant(*args, **kwargs):  # after OUT was checked and locked
        run = setup(*args, **kwargs)
        (out / "tensorboard").symlink_to(elsewhere, target_is_directory=True)
        return run

    monkeypatch.setattr(train, "setup", setup_then_plant)
    argv = ["--steps", "1", "--batch-size", "2", "--seq-len", "16", "--max-bytes", "20000", "--set",
            "model.n_layers=1", "--set", "model.d_model=32", "--set", "model.n_heads=2", "--set",
            "model.n_kv_heads=1", "--set", "model.d_ff=64", "--no-plot", "--peak-flops", "1e9", "--tensorboard",
            "--out", str(out)]
    assert train.main(argv) == 2
    assert "tensorboard is a symbolic link or not a directory" in one_line(capsys)
    assert list(elsewhere.iterdir()) == []


def test_the_tensorboard_directory_checked_is_the_one_written(tmp_path):
    """The writer writes through the checked directory's descriptor: swapping the name afterwards changes nothing."""
    pytest.importorskip("tensorboard")
    from minidist.train.dashboard import Dashboard
    board = Dashboard(tmp_path, 0)
    (tmp_path / "tensorboard").rename(tmp_path / "moved")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "tensorboard").symlink_to(elsewhere, target_is_directory=True)
    board.write([{"step": 0, "loss": 1.0}])
    board.close()
    assert list(elsewhere.iterdir()) == [] and any((tmp_path / "moved").iterdir())
