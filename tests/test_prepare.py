"""Tests for the data pipeline: tokenizers (minidist.data.tokenizer), `python -m minidist.data prepare`
(minidist.data.prepare, minidist.data.documents), a dataset read as untrusted input (minidist.data.dataset) and the
memory-mapped token stream the sampler reads (minidist.data.shards, minidist.data.sampler). Every dataset is made
here, from a few small text files."""

import hashlib
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from minidist.data import dataset, prepare, tokenizer
from minidist.data.corpus import FILE_SEPARATOR, load_corpus
from minidist.data.sampler import BatchSampler
from minidist.data.shards import TokenShards

ROOT = Path(__file__).resolve().parents[1]
TEXTS = {  # a small corpus: code, prose, non-ASCII, an empty file, a nested directory
    "a.py": "def add(a, b):\n    return a + b\n\n\nprint(add(1, 2))\n" * 40,
    "notes/b.md": "# Notes\n\nDistributed training splits the work; parity keeps it honest. — π ≈ 3.14\n" * 30,
    "notes/c.txt": "the quick brown fox jumps over the lazy dog\n" * 50,
    "d.txt": "",
    "e.txt": "日本語のテキスト。\n" * 20 + "tail without newline",
}


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    for name, text in TEXTS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    (root / ".hidden").write_text("skipped")
    (root / "blob.bin").write_bytes(b"\0binary")
    return root


def files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir())}


# ------------------------------------------------------------------------------------------------------------------
# tokenizers


def test_the_byte_tokenizer_json_gives_the_byte_values():
    tok = tokenizer.byte_tokenizer()
    text = "héllo  wörld\n\n\tdef f():\x1c 日本 🙂"
    rust = Tokenizer.from_str(tok.json)
    assert rust.encode(text).ids == list(text.encode()) == tok.encode(text.encode()).tolist()
    assert rust.decode(list(text.encode())) == text
    assert (tok.vocab_size, tok.eod_id, rust.get_vocab_size()) == (256, FILE_SEPARATOR[0], 256)


def test_transformers_loads_the_byte_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")  # the bench extra (make test installs it)
    (tmp_path / "tokenizer.json").write_text(tokenizer.byte_tokenizer().json)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    text = "héllo wörld\n\x1c def f(): 日本"
    assert hf(text)["input_ids"] == list(text.encode()) and hf.decode(list(text.encode())) == text


def test_bpe_training_is_deterministic_and_padded_to_the_asked_vocabulary():
    texts = list(TEXTS.values())
    one, two = tokenizer.train_bpe(texts, 400), tokenizer.train_bpe(texts, 400)
    assert one.json == two.json  # the same JSON, byte for byte
    assert (one.vocab_size, one.eod_id) == (400, 0)
    big = tokenizer.resolve_tokenizer("bpe:32768", texts)  # the corpus runs out of merges long before 32768
    rust = Tokenizer.from_str(big.json)
    assert big.vocab_size == rust.get_vocab_size() == 32768 and big.dtype == np.uint16
    assert "<|reserved_0|>" in rust.get_vocab()
    ids = big.encode(TEXTS["notes/b.md"].encode())
    assert rust.decode(ids.tolist()) == TEXTS["notes/b.md"] and ids.max() < 32768


def test_bpe_training_is_the_same_json_whatever_the_threads(tmp_path):
    """Rust's thread pool is sized once per process (RAYON_NUM_THREADS): each count trained in a fresh process."""
    (tmp_path / "texts.json").write_text(json.dumps(list(TEXTS.values())))
    code = ("import hashlib, json, sys; from minidist.data.tokenizer import train_bpe; "
            "print(hashlib.sha256(train_bpe(json.load(open(sys.argv[1])), 400).json.encode()).hexdigest())")
    digests = {subprocess.run([sys.executable, "-c", code, str(tmp_path / "texts.json")], capture_output=True,
                              text=True, check=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                                       "RAYON_NUM_THREADS": str(n)}).stdout
               for n in (1, 4)}
    assert digests == {hashlib.sha256(tokenizer.train_bpe(list(TEXTS.values()), 400).json.encode()).hexdigest()
                       + "\n"}


def test_a_tokenizer_json_is_read_as_untrusted_input(tmp_path):
    tok = tokenizer.train_bpe(list(TEXTS.values()), 300)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text(tok.json)
    loaded = tokenizer.resolve_tokenizer(str(tmp_path / "model"))  # a model directory holding one
    assert (loaded.json, loaded.vocab_size, loaded.eod_id) == (tok.json, 300, 0)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a tokenizers JSON"):
        tokenizer.resolve_tokenizer(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="no end-of-document token"):
        tokenizer.load_tokenizer_json(tmp_path / "model", eod_token="<missing>")
    with pytest.raises(ValueError, match="not a regular file"):
        tokenizer.resolve_tokenizer(str(tmp_path / "nothing.json"))
    with pytest.raises(ValueError, match="VOCAB must be an integer"):
        tokenizer.resolve_tokenizer("bpe:big", [])


# ------------------------------------------------------------------------------------------------------------------
# prepare


def test_prepare_is_the_same_bytes_whatever_the_workers(corpus_dir, tmp_path):
    """--workers 2 through the command line (spawned workers, a progress line) and 1 in this process."""
    one = tmp_path / "one"
    prepare.prepare(str(corpus_dir), "bpe:300", one, workers=1, val_fraction=0.3, shard_tokens=500, progress=False)
    cmd = [sys.executable, "-m", "minidist.data", "prepare", str(corpus_dir), "--tokenizer", "bpe:300", "--out",
           str(tmp_path / "two"), "--workers", "2", "--val-fraction", "0.3", "--shard-tokens", "500"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert "prepare: " in done.stderr and "100%" in done.stderr
    assert files(one) == files(tmp_path / "two")
    assert len([n for n in files(one) if n.startswith("train_0")]) > 1  # the stream crosses shard files


def test_a_byte_dataset_is_the_text_source_with_an_eod_closing_each_document(corpus_dir, tmp_path):
    m = prepare.prepare(str(corpus_dir), "bytes", tmp_path, val_fraction=0.3, progress=False)
    ds = dataset.open_dataset(tmp_path)
    text = load_corpus(str(corpus_dir), val_fraction=0.3)  # the same split: by file, by the hash of the names
    for name, want in (("train", text.train), ("val", text.val)):
        got = ds.splits[name].read(0, ds.splits[name].numel())
        docs = [d for d in bytes(want.numpy()).split(FILE_SEPARATOR) if d]  # an empty file is no document
        assert bytes(got.astype(np.uint8)) == b"".join(d + FILE_SEPARATOR for d in docs), name
    ends = np.fromfile(tmp_path / "train_docs.bin", dtype="<i8")
    empty = "d.txt" in text.train_files  # an empty file is no document
    assert len(ends) == m["splits"]["train"]["documents"]["count"] == len(text.train_files) - empty
    assert (ds.splits["train"].read(0, int(ends[-1]))[ends - 1] == 0x1C).all()
    assert m["dtype"] == "uint16" and m["eod_id"] == 0x1C
    assert hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest() == ds.tokenizer_sha256


def test_documents_decode_to_their_files(corpus_dir, tmp_path):
    prepare.prepare(str(corpus_dir), "bpe:300", tmp_path, val_fraction=0, progress=False)
    ds = dataset.open_dataset(tmp_path)
    tok = tokenizer.load_tokenizer_json(tmp_path)
    ends = np.fromfile(tmp_path / "train_docs.bin", dtype="<i8")
    starts = np.concatenate([[0], ends[:-1]])
    docs = [tok.decode(ds.splits["train"].read(int(a), int(b - a) - 1)) for a, b in zip(starts, ends)]
    assert docs == [TEXTS[n] for n in sorted(TEXTS) if TEXTS[n]]  # in name order, EOD left out


def test_prepare_refuses_a_used_out_and_overwrites_only_a_dataset(corpus_dir, tmp_path):
    prepare.prepare(str(corpus_dir), "bytes", tmp_path / "ds", progress=False)
    with pytest.raises(ValueError, match="not empty"):
        prepare.prepare(str(corpus_dir), "bytes", tmp_path / "ds", progress=False)
    prepare.prepare(str(corpus_dir), "bytes", tmp_path / "ds", overwrite=True, progress=False)
    inside = corpus_dir / "data"  # a dataset inside its own source: its files are no documents the next time
    first = prepare.prepare(str(corpus_dir), "bytes", inside, progress=False)
    try:
        assert prepare.prepare(str(corpus_dir), "bytes", inside, overwrite=True, progress=False) == first
    finally:
        for p in inside.iterdir():
            p.unlink()
        inside.rmdir()
    (tmp_path / "ds" / "mine.txt").write_text("a user's file")
    with pytest.raises(ValueError, match="no dataset's"):
        prepare.prepare(str(corpus_dir), "bytes", tmp_path / "ds", overwrite=True, progress=False)
    assert (tmp_path / "ds" / "mine.txt").read_text() == "a user's file"
    assert (tmp_path / "ds" / "manifest.json").exists()


def test_prepare_reads_a_single_file_up_to_max_bytes(tmp_path):
    src = tmp_path / "big.txt"
    src.write_bytes(b"line of text\n" * 10_000)  # 130 kB, read 20 kB of it
    m = prepare.prepare(str(src), "bytes", tmp_path / "ds", max_bytes=20_000, val_fraction=0.1, progress=False)
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == 20_000 + 2  # an EOD per split
    assert m["splits"]["val"]["tokens"] == 2_000 + 1


def test_a_file_name_that_is_not_utf8_is_prepared(tmp_path):
    """A document's name only places it in a split (a hash of its bytes): a name that is not UTF-8 (bytes a Linux
    file system allows) is prepared like any other, and a UTF-8 name hashes as its UTF-8 bytes (the split of
    every earlier dataset unchanged)."""
    from minidist.data.documents import _path_hash

    src = tmp_path / "src"
    src.mkdir()
    try:
        (src / os.fsdecode(b"latin1-\xe9.txt")).write_bytes(b"some text\n" * 100)
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses a name that is not UTF-8")
    (src / "plain.txt").write_bytes(b"other text\n" * 100)
    m = prepare.prepare(str(src), "bytes", tmp_path / "ds", val_fraction=0.5, progress=False)
    assert sum(split["documents"]["count"] for split in m["splits"].values()) == 2
    name = "caf\u00e9/x.txt"
    assert _path_hash(name) == int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "big")


# ------------------------------------------------------------------------------------------------------------------
# a dataset read as untrusted input


@pytest.fixture
def made(corpus_dir, tmp_path) -> Path:
    prepare.prepare(str(corpus_dir), "bytes", tmp_path, val_fraction=0.3, shard_tokens=700, progress=False)
    return tmp_path


def edit_manifest(root: Path, change) -> None:
    m = json.loads((root / "manifest.json").read_text())
    change(m)
    (root / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("case, words", [
    ("version", "version 2"), ("dtype", "dtype 'int8' is unknown"), ("size lie", "bytes but the manifest says"),
    ("escape", "not a plain file name"), ("absolute", "not a plain file name"), ("fifo", "not a regular file"),
    ("dev zero link", "links out of the dataset"), ("index longer", "index ends at token"),
    ("missing", "is missing"), ("eod", "eod_id"),
])
def test_a_manifest_that_lies_is_one_line(made, case, words):
    shard = made / "train_00000.bin"
    if case == "version":
        edit_manifest(made, lambda m: m.update(version=2))
    elif case == "dtype":
        edit_manifest(made, lambda m: m.update(dtype="int8"))
    elif case == "size lie":
        edit_manifest(made, lambda m: m["splits"]["train"]["shards"][0].update(tokens=10**9))
        edit_manifest(made, lambda m: m["splits"]["train"].update(
            tokens=sum(s["tokens"] for s in m["splits"]["train"]["shards"])))
    elif case in ("escape", "absolute"):
        name = "../train_00000.bin" if case == "escape" else "/dev/zero"
        edit_manifest(made, lambda m: m["splits"]["train"]["shards"][0].update(file=name))
    elif case == "fifo":
        shard.unlink()
        os.mkfifo(shard)
    elif case == "dev zero link":
        shard.unlink()
        shard.symlink_to("/dev/zero")
    elif case == "index longer":  # the shards shorter than the index: the last shard cut, the manifest made to agree
        last = sorted(made.glob("train_0*.bin"))[-1]
        last.write_bytes(last.read_bytes()[:-20])
        edit_manifest(made, lambda m: (m["splits"]["train"]["shards"][-1].update(
            tokens=m["splits"]["train"]["shards"][-1]["tokens"] - 10), m["splits"]["train"].update(
            tokens=m["splits"]["train"]["tokens"] - 10)))
    elif case == "missing":
        shard.unlink()
    elif case == "eod":
        edit_manifest(made, lambda m: m.update(eod_id=256, vocab_size=256))
    with pytest.raises(ValueError, match=words) as err:
        dataset.open_dataset(made, verify=False)  # every lie above is caught before any hash
    assert "\n" not in str(err.value)


def test_a_changed_shard_fails_its_hash(made):
    shard = made / "train_00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    dataset.open_dataset(made, verify=False)  # sizes still agree
    with pytest.raises(ValueError, match="train_00001.bin' does not match its SHA-256"):
        dataset.open_dataset(made, verify=True)


# ------------------------------------------------------------------------------------------------------------------
# the memory-mapped stream and the sampler


def test_sampler_over_shards_gives_the_tensor_batches_and_reads_only_a_rank_rows(made):
    ds = dataset.open_dataset(made)
    stream = ds.splits["train"]
    whole = torch.from_numpy(stream.read(0, stream.numel()))
    assert len(stream.paths) > 2
    on_disk, in_memory = BatchSampler(stream, 64, 8, seed=3), BatchSampler(whole, 64, 8, seed=3)
    for step in range(5):  # windows straddle the 700-token shard boundaries
        assert all(torch.equal(a, b) for a, b in zip(on_disk.batch(step), in_memory.batch(step)))
    before = stream.tokens_read
    rows = on_disk.shard(7, rank=1, world=4)
    assert stream.tokens_read - before == 2 * 65  # 8 rows / 4 ranks, seq_len + 1 tokens each: nothing else
    assert all(torch.equal(a, b) for a, b in zip(rows, in_memory.shard(7, rank=1, world=4)))
    state = on_disk.state_dict()
    assert state["num_tokens"] == whole.numel()
    in_memory.load_state_dict(state)  # one position, whichever source


def test_a_rank_memory_does_not_grow_with_the_dataset(tmp_path):
    """A 4 GiB shard (sparse: it costs no disk) sampled from: mapping it reads only the rows, where loading it would
    raise the process's peak memory by gigabytes."""
    big = tmp_path / "train_00000.bin"
    with open(big, "wb") as f:
        f.truncate(2**32)
    stream = TokenShards([big], [2**31], np.dtype("<u2"))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    sampler = BatchSampler(stream, 256, 64, seed=0)
    for step in range(3):  # (a page fault in a hole of a sparse file costs ~4 ms here: few rows)
        inputs, _ = sampler.shard(step, 0, 2)
        assert inputs.shape == (32, 256) and int(inputs.max()) == 0
    assert stream.tokens_read == 3 * 32 * 257
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 64 * 1024  # < 64 MiB more, of 4 GiB


def test_max_bytes_on_a_directory_reads_only_what_it_keeps(corpus_dir, tmp_path):
    """A text source (the trainer's in-memory path): a 1 GiB file (text, then a sparse hole) in the directory is
    never read whole when --max-bytes keeps 2,000 bytes; the data is the head of the uncapped corpus's splits."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("a.py", "notes/c.txt"):
        (src / name).parent.mkdir(exist_ok=True)
        (src / name).write_bytes((corpus_dir / name).read_bytes())
    with open(src / "huge.txt", "wb") as f:
        f.write(b"text at the head of a huge file\n" * 300)
        f.truncate(2**30)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    capped = load_corpus(str(src), val_fraction=0.3, max_bytes=2000)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 64 * 1024  # KiB: far below the 1 GiB
    assert capped.train.numel() + capped.val.numel() == 2000 and "capped at max_bytes=2,000" in capped.description
    (src / "huge.txt").write_bytes(b"text at the head of a huge file\n" * 300)  # same split order, readable whole
    whole = load_corpus(str(src), val_fraction=0.3)
    assert capped.val_files == whole.val_files
    assert torch.equal(capped.train, whole.train[: capped.train.numel()])
    assert torch.equal(capped.val, whole.val[: capped.val.numel()])


@pytest.mark.parametrize("source", ["fifo", "/dev/zero", "tokens.bin", "missing", "empty"])
def test_prepare_refuses_a_source_it_cannot_read_in_one_line(tmp_path, source):
    if source == "fifo":
        os.mkfifo(tmp_path / "fifo")
    if source == "tokens.bin":
        (tmp_path / "tokens.bin").write_bytes(b"abc")
    if source == "empty":
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "a.txt").write_text("")
    path = source if source.startswith("/") else str(tmp_path / source)
    with pytest.raises(ValueError, match="not a regular file|holds tokens already|does not exist|holds no text") as err:
        prepare.prepare(path, "bytes", tmp_path / "out", progress=False)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()  # refused before --out is touched


def test_a_vocabulary_above_65536_is_stored_as_uint32(tmp_path):
    (tmp_path / "a.txt").write_text(TEXTS["notes/b.md"])
    m = prepare.prepare(str(tmp_path / "a.txt"), "bpe:70000", tmp_path / "out", val_fraction=0, progress=False)
    ds = dataset.open_dataset(tmp_path / "out")
    assert m["dtype"] == "uint32" and (tmp_path / "out" / "train_00000.bin").stat().st_size == 4 * m["splits"][
        "train"]["tokens"]
    ids = ds.splits["train"].read(0, ds.splits["train"].numel())
    assert tokenizer.load_tokenizer_json(tmp_path / "out").decode(ids[:-1]) == TEXTS["notes/b.md"] and ids[-1] == 0


def test_max_bytes_on_a_npy_file_reads_only_what_it_keeps(tmp_path):
    """A 1 GiB .npy of int64 token ids (sparse: zeros) with --max-bytes 1000: mapped, the kept ids alone read."""
    arr = np.lib.format.open_memmap(tmp_path / "tokens.npy", mode="w+", dtype=np.int64, shape=(2**27,))
    arr[:10] = np.arange(10)
    arr.flush()
    del arr
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    capped = load_corpus(str(tmp_path / "tokens.npy"), val_fraction=0.1, max_bytes=1000)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 64 * 1024  # KiB: far below the 1 GiB
    assert capped.train.numel() + capped.val.numel() == 1000 and capped.train[:10].tolist() == list(range(10))
