"""Tests for minidist.data.corpus: tokenizer, corpus sources and splits, the deterministic sampler, the entropy
baseline."""

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from minidist.data import corpus
from minidist.data.corpus import FILE_SEPARATOR, BatchSampler, ByteTokenizer, load_corpus

SMALL = 400_000  # bytes of stdlib for the split tests: fast, yet a dozen files


def as_bytes(t: torch.Tensor) -> bytes:
    return t.numpy().tobytes()


# ------------------------------------------------------------------------------------------------------------------
# tokenizer


@pytest.mark.parametrize("text", ["", "hello, world\n", "héllo wörld — π ≈ 3.14 ∑ 日本語 🙂", "\x00\x1c\x7f"])
def test_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < corpus.VOCAB_SIZE for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids, dtype=torch.uint8)) == text


def test_tokenizer_vocab_and_invalid_bytes():
    tok = ByteTokenizer()
    assert tok.vocab_size == corpus.VOCAB_SIZE == 256
    assert len(tok.encode("é")) == 2  # non-ASCII costs several tokens
    assert tok.decode([0x68, 0xFF, 0x69]) == "h\ufffdi"  # invalid UTF-8 is replaced, not raised
    with pytest.raises(ValueError, match="256"):
        tok.decode([300])


# ------------------------------------------------------------------------------------------------------------------
# the default corpus


def test_stdlib_files_exist_and_are_big_enough():
    root = corpus.stdlib_root()
    names = corpus.stdlib_files()
    assert len(names) > 100
    assert names == sorted(names)
    assert {"os.py", "json/decoder.py", "collections/__init__.py"} <= set(names)
    for name in names:
        parts = Path(name).parts
        assert not set(parts[:-1]) & {"site-packages", "dist-packages", "test", "tests", "idle_test"}, name
        assert name.endswith(".py")
    total = sum((root / n).stat().st_size for n in names)
    assert total > 2_000_000


def test_stdlib_corpus_split_by_file_and_deterministic():
    corpus._load_stdlib.cache_clear()  # the loader's lru_cache: both reads below come from the files
    a = load_corpus(max_bytes=SMALL)
    corpus._load_stdlib.cache_clear()
    b = load_corpus(max_bytes=SMALL)  # a fresh read, not the cache
    assert torch.equal(a.train, b.train) and torch.equal(a.val, b.val)
    assert (a.train_files, a.val_files, a.description) == (b.train_files, b.val_files, b.description)

    assert a.train.dtype == torch.uint8 and a.train.dim() == 1 and a.val.dtype == torch.uint8
    assert a.val.numel() > 0 and a.train.numel() > a.val.numel()
    assert not set(a.train_files) & set(a.val_files)
    # The cap keeps a prefix of the sorted file list.
    kept = sorted(a.train_files + a.val_files)
    assert kept == corpus.stdlib_files()[: len(kept)]
    assert a.train.numel() + a.val.numel() + len(FILE_SEPARATOR) <= SMALL

    # Each split is its files, read independently, joined with the separator.
    root = corpus.stdlib_root()
    assert as_bytes(a.train) == FILE_SEPARATOR.join((root / n).read_bytes() for n in a.train_files)
    assert as_bytes(a.val) == FILE_SEPARATOR.join((root / n).read_bytes() for n in a.val_files)
    file_bytes = sum((root / n).stat().st_size for n in kept)
    assert sum((root / n).stat().st_size for n in a.val_files) >= 0.05 * file_bytes
    assert str(root) in a.description and "capped" in a.description


def test_stdlib_cache_returns_independent_tensors():
    a = load_corpus(max_bytes=SMALL)
    a.train[:10] = 0
    b = load_corpus(max_bytes=SMALL)
    assert not torch.equal(a.train[:10], b.train[:10])


def test_stdlib_cap_smaller_than_first_file():
    c = load_corpus(max_bytes=100, val_fraction=0.1)
    assert c.train.numel() + c.val.numel() == 100
    first = (corpus.stdlib_root() / corpus.stdlib_files()[0]).read_bytes()[:100]
    assert as_bytes(c.train) + as_bytes(c.val) == first
    assert c.val.numel() == 10


# ------------------------------------------------------------------------------------------------------------------
# user sources


def write_tree(root: Path, n: int, size: int = 200) -> dict[str, bytes]:
    files = {}
    for i in range(n):
        name = f"sub{i % 3}/doc_{i:03d}.txt"
        body = (f"document {i} " * size).encode()[:size] + "é".encode()
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(body)
        files[name] = body
    return files


def test_directory_source(tmp_path):
    files = write_tree(tmp_path, 12)
    (tmp_path / ".hidden.txt").write_text("secret")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main")
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00")
    c = load_corpus(str(tmp_path), val_fraction=0.2)
    assert set(c.train_files) | set(c.val_files) == set(files)
    assert not set(c.train_files) & set(c.val_files)
    assert list(c.train_files) == sorted(c.train_files)
    assert as_bytes(c.train) == FILE_SEPARATOR.join(files[n] for n in c.train_files)
    assert as_bytes(c.val) == FILE_SEPARATOR.join(files[n] for n in c.val_files)
    assert sum(len(files[n]) for n in c.val_files) >= 0.2 * sum(map(len, files.values()))
    assert len(c.train_files) >= 1
    again = load_corpus(str(tmp_path), val_fraction=0.2)
    assert again.val_files == c.val_files


def test_adding_a_file_moves_few_others(tmp_path):
    # With equal-sized files, one new file shifts the cut by at most one place: at most 2 old files change sides.
    # A split by shuffling the file list would move about half of them.
    write_tree(tmp_path, 40)
    before = load_corpus(str(tmp_path), val_fraction=0.25)
    (tmp_path / "sub0" / "doc_new.txt").write_bytes(b"x" * len((tmp_path / "sub0" / "doc_000.txt").read_bytes()))
    after = load_corpus(str(tmp_path), val_fraction=0.25)
    moved = (set(before.val_files) ^ set(after.val_files)) - {"sub0/doc_new.txt"}
    assert len(moved) <= 2
    assert len(before.val_files) == 10


def test_single_text_file_splits_by_last_bytes(tmp_path):
    text = "".join(f"line {i}: ünïcödé\n" for i in range(500)).encode()
    path = tmp_path / "book.txt"
    path.write_bytes(text)
    c = load_corpus(str(path), val_fraction=0.1)
    n_val = round(len(text) * 0.1)
    assert as_bytes(c.val) == text[len(text) - n_val :]
    assert as_bytes(c.train) == text[: len(text) - n_val]
    assert c.train_files == c.val_files == ("book.txt",)


def test_glob_source(tmp_path):
    files = write_tree(tmp_path, 6)
    (tmp_path / "notes.md").write_text("not matched")
    c = load_corpus(str(tmp_path / "**" / "*.txt"), val_fraction=0.2)
    got = {Path(n).relative_to(tmp_path).as_posix() for n in c.train_files + c.val_files}
    assert got == set(files)
    assert not set(c.train_files) & set(c.val_files)
    with pytest.raises(ValueError, match="matches no files"):
        load_corpus(str(tmp_path / "*.nothing"))


def test_bin_and_npy_sources(tmp_path):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, size=10_001).astype(np.uint8)
    tokens.tofile(tmp_path / "tokens.bin")
    c = load_corpus(str(tmp_path / "tokens.bin"), val_fraction=0.05)
    n_val = round(tokens.size * 0.05)
    assert c.val.numel() == n_val
    assert np.array_equal(torch.cat([c.train, c.val]).numpy(), tokens)
    assert np.array_equal(c.val.numpy(), tokens[-n_val:])

    np.save(tmp_path / "tokens.npy", tokens.astype(np.int64))
    d = load_corpus(str(tmp_path / "tokens.npy"), val_fraction=0.05)
    assert torch.equal(d.train, c.train) and torch.equal(d.val, c.val)

    np.save(tmp_path / "big.npy", np.array([1, 2, 300]))
    with pytest.raises(ValueError, match="256"):
        load_corpus(str(tmp_path / "big.npy"))


def test_user_source_max_bytes(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(bytes(range(256)) * 40)
    c = load_corpus(str(path), val_fraction=0.1, max_bytes=1000)
    assert c.train.numel() + c.val.numel() == 1000
    assert c.val.numel() == 100


def test_missing_path_error_is_one_line(tmp_path):
    missing = str(tmp_path / "no_such_corpus")
    with pytest.raises(ValueError) as info:
        load_corpus(missing)
    msg = str(info.value)
    assert "\n" not in msg
    assert repr(missing) in msg and "does not exist" in msg and "'stdlib'" in msg


def test_bad_arguments():
    with pytest.raises(ValueError, match="val_fraction"):
        load_corpus(val_fraction=1.0)
    with pytest.raises(ValueError, match="max_bytes"):
        load_corpus(max_bytes=0)


def test_zero_val_fraction(tmp_path):
    write_tree(tmp_path, 4)
    c = load_corpus(str(tmp_path), val_fraction=0.0)
    assert c.val.numel() == 0 and len(c.train_files) == 4


# ------------------------------------------------------------------------------------------------------------------
# sampler


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (5_000,), generator=g, dtype=torch.uint8)


def test_same_seed_and_step_give_same_batch(tokens):
    a = BatchSampler(tokens, seq_len=32, global_batch=8, seed=7)
    b = BatchSampler(tokens, seq_len=32, global_batch=8, seed=7)
    for step in [0, 1, 5, 1000, 3]:  # any order: random access
        xa, ya = a.batch(step)
        xb, yb = b.batch(step)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert xa.shape == ya.shape == (8, 32)
    assert xa.dtype == ya.dtype == torch.int64
    assert not torch.equal(a.batch(0)[0], a.batch(1)[0])
    c = BatchSampler(tokens, seq_len=32, global_batch=8, seed=8)
    assert not torch.equal(a.batch(0)[0], c.batch(0)[0])


def test_windows_come_from_the_corpus(tokens):
    # A sampler over positions, with the same seed and length, draws the same offsets: it tells where rows came from.
    seq, batch = 16, 8
    positions = BatchSampler(torch.arange(tokens.numel()), seq, batch, seed=3)
    sampler = BatchSampler(tokens, seq, batch, seed=3)
    for step in range(5):
        pos_x, pos_y = positions.batch(step)
        x, y = sampler.batch(step)
        assert torch.equal(pos_y, pos_x + 1)  # contiguous windows, targets one further
        assert torch.equal(pos_x, pos_x[:, :1] + torch.arange(seq))
        assert torch.equal(x, tokens[pos_x].long())
        assert torch.equal(y, tokens[pos_y].long())
        assert torch.equal(x[:, 1:], y[:, :-1])


def test_offsets_cover_the_whole_range():
    # Corpus of seq_len + 3 tokens: offsets in {0, 1, 2}; all appear, and the last token is used as a target.
    seq = 10
    sampler = BatchSampler(torch.arange(seq + 3), seq, global_batch=8, seed=0)
    starts = torch.cat([sampler.batch(s)[0][:, 0] for s in range(50)])
    assert set(starts.tolist()) == {0, 1, 2}
    assert int(torch.cat([sampler.batch(s)[1] for s in range(50)]).max()) == seq + 2
    # A corpus of exactly seq_len + 1 tokens has one window.
    x, y = BatchSampler(torch.arange(seq + 1), seq, 2, seed=0).batch(0)
    assert torch.equal(x, torch.arange(seq).expand(2, -1)) and torch.equal(y, torch.arange(1, seq + 1).expand(2, -1))


def test_shards_concatenate_to_the_global_batch(tokens):
    sampler = BatchSampler(tokens, seq_len=8, global_batch=12, seed=1)
    for world in [1, 2, 3, 4, 6, 12]:
        for step in [0, 9]:
            x, y = sampler.batch(step)
            parts = [sampler.shard(step, r, world) for r in range(world)]
            assert all(p[0].shape == (12 // world, 8) for p in parts)
            assert torch.equal(torch.cat([p[0] for p in parts]), x)
            assert torch.equal(torch.cat([p[1] for p in parts]), y)


def test_shard_errors(tokens):
    sampler = BatchSampler(tokens, seq_len=8, global_batch=12, seed=1)
    with pytest.raises(ValueError, match="not divisible") as info:
        sampler.shard(0, 0, 5)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="rank"):
        sampler.shard(0, 4, 4)


def test_resume_from_state_dict(tokens):
    a = BatchSampler(tokens, seq_len=16, global_batch=4, seed=11)
    for _ in range(5):
        a.next_batch()
    state = a.state_dict()
    assert state["step"] == 5 and state["seed"] == 11
    expected = [next(a) for _ in range(3)]
    b = BatchSampler(tokens, seq_len=16, global_batch=4, seed=11)
    b.load_state_dict(state)
    for want in expected:
        got = b.next_batch()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert b.step == 8
    assert torch.equal(expected[0][0], a.batch(5)[0])


def test_load_state_dict_rejects_other_settings(tokens):
    state = BatchSampler(tokens, seq_len=16, global_batch=4, seed=11).state_dict()
    other = BatchSampler(tokens, seq_len=16, global_batch=4, seed=12)
    with pytest.raises(ValueError, match="seed 11 in state vs 12 here") as info:
        other.load_state_dict(state)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="global_batch"):
        BatchSampler(tokens, seq_len=16, global_batch=8, seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match="lacks"):
        other.load_state_dict({"seed": 12})


def test_sampler_validation(tokens):
    with pytest.raises(ValueError, match="seq_len"):
        BatchSampler(tokens, seq_len=0, global_batch=4, seed=0)
    with pytest.raises(ValueError, match="global_batch"):
        BatchSampler(tokens, seq_len=4, global_batch=0, seed=0)
    with pytest.raises(ValueError, match="10 tokens.*seq_len \\+ 1 = 11") as info:
        BatchSampler(torch.zeros(10, dtype=torch.uint8), seq_len=10, global_batch=1, seed=0)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="step"):
        BatchSampler(tokens, seq_len=4, global_batch=1, seed=0).batch(-1)


def test_sampler_on_a_loaded_corpus():
    corpus = load_corpus(max_bytes=SMALL)
    x, y = BatchSampler(corpus.train, seq_len=32, global_batch=4, seed=0).batch(0)
    assert x.shape == (4, 32) and int(x.max()) < 256 and int(x.min()) >= 0


# ------------------------------------------------------------------------------------------------------------------
# entropy baseline


def test_unigram_entropy_by_hand():
    t = torch.tensor([0, 0, 1, 2], dtype=torch.uint8)  # p = 1/2, 1/4, 1/4
    assert corpus.unigram_entropy_bits(t) == pytest.approx(1.5)
    assert corpus.unigram_entropy_nats(t) == pytest.approx(1.5 * math.log(2))
    t = torch.tensor([7, 7, 7, 200])  # p = 3/4, 1/4
    assert corpus.unigram_entropy_bits(t) == pytest.approx(-(0.75 * math.log2(0.75) + 0.25 * math.log2(0.25)))
    assert corpus.unigram_entropy_bits(torch.full((5,), 42)) == 0.0
    assert corpus.unigram_entropy_bits(torch.arange(256).repeat(3)) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="empty"):
        corpus.unigram_entropy_bits(torch.empty(0, dtype=torch.uint8))
