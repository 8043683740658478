"""The trainer on a prepared dataset (`--data DATA_DIR`, minidist.data.training_data): a real vocabulary end to end
(a 32,768-token BPE: the vocab-parallel loss under tp 2, a pipeline of 2 stages and the chunked loss each log the
one-process run), the model's vocabulary following the tokenizer's, OUT/tokenizer.json, and a resume that refuses
a different dataset (and takes the same one moved). One launch of 2 ranks runs both parallel layouts, under the
device sentinel (tests/device_sentinel.py)."""

import functools
import json
import shutil
from pathlib import Path

import pytest
import trainer_parity
from device_sentinel import device_sentinel

from minidist.comm.launch import run_ranks
from minidist.data import prepare, tokenizer
from minidist.train import loop as train
from minidist.train.config import ConfigError, TrainConfig, check_config

MODEL = {"n_layers": 2, "d_model": 32, "n_heads": 2, "n_kv_heads": 2, "d_ff": 64, "max_seq_len": 32}
VOCAB = 32768
LAYOUTS = {"tp2 vocab-parallel loss": dict(tp=2), "pp2 1f1b": dict(pp=2)}
TEXT = "".join(f"def step_{i}(x):\n    return x * {i} + {i % 7}  # parity is the law\n\n" for i in range(120))


def config(out: str, data: str, **changes) -> TrainConfig:
    """2 steps of batch 4 x 32, clipping active, 2 evaluations; the model's vocabulary left to the data."""
    settings = dict(model="tiny", model_overrides=dict(MODEL), data=data, batch_size=4, seq_len=32, microbatches=2,
                    steps=2, warmup_steps=1, grad_clip=1.0, eval_every=1, eval_batches=1, log_every=100,
                    ckpt_every=0, out=out, seed=0, peak_flops=1e12, plot=False)
    return TrainConfig(**{**settings, **changes})


@functools.lru_cache(maxsize=1)
def _dataset(root: str) -> str:
    src = Path(root) / "src"
    src.mkdir(parents=True)
    for i in range(4):  # four documents, one of them validation
        (src / f"doc{i}.py").write_text(TEXT[i * 1000:] + TEXT[: i * 1000])
    prepare.prepare(str(src), f"bpe:{VOCAB}", Path(root) / "data", val_fraction=0.2, progress=False)
    return str(Path(root) / "data")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    return _dataset(str(tmp_path_factory.mktemp("bpe")))


@pytest.fixture(scope="module")
def reference(data, tmp_path_factory) -> tuple[str, list[dict]]:
    out = str(tmp_path_factory.mktemp("reference"))
    return out, trainer_parity.single_process_records(out, lambda o: config(o, data))


def _rank_layouts(root: str, data: str) -> dict:
    with device_sentinel():  # a tensor of the data path made without device= fails here, as on a GPU
        return trainer_parity.train_layouts(root, LAYOUTS, functools.partial(config, data=data))


def test_a_32k_vocabulary_runs_tp_and_pp_as_one_process(data, reference, tmp_path):
    results = run_ranks(_rank_layouts, 2, str(tmp_path), data, timeout=300, threads_per_rank=1)
    for name in LAYOUTS:
        trainer_parity.assert_logs_match(name, results[0][name]["records"], reference[1])


def test_the_chunked_loss_on_a_32k_vocabulary_is_the_one_process_run(data, reference, tmp_path):
    chunked = trainer_parity.single_process_records(str(tmp_path), lambda o: config(o, data, loss_chunk=24))
    trainer_parity.assert_logs_match("loss_chunk 24", chunked, reference[1])


def test_the_run_carries_the_dataset_vocabulary_and_tokenizer(data, reference):
    out, _ = reference
    info = json.loads((Path(out) / "run.json").read_text())
    assert info["model"]["vocab_size"] == VOCAB and info["config"]["model"]["vocab_size"] == VOCAB
    assert (Path(out) / "tokenizer.json").read_bytes() == (Path(data) / "tokenizer.json").read_bytes()
    assert info["data_identity"]["tokenizer_sha256"] == json.loads((Path(data) / "manifest.json").read_text())[
        "tokenizer"]["sha256"]


def test_a_byte_run_writes_the_byte_tokenizer(tmp_path):
    train.train(config(str(tmp_path), "stdlib", max_bytes=20_000, steps=1, model_overrides={**MODEL}))
    assert (tmp_path / "tokenizer.json").read_text() == tokenizer.byte_tokenizer().json


def test_a_vocabulary_that_differs_from_the_data_is_refused(data, tmp_path):
    with pytest.raises(ConfigError, match="model.vocab_size 50,000 differs from the 32,768") as err:
        check_config(config(str(tmp_path), data, model_overrides={**MODEL, "vocab_size": 50_000}))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="--max-bytes applies to a text source"):
        check_config(config(str(tmp_path), data, max_bytes=1000))


def test_a_resume_refuses_another_dataset_in_the_same_place_and_takes_it_moved(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text(TEXT)
    prepare.prepare(str(src), "bytes", tmp_path / "data", val_fraction=0, progress=False)
    out, small = str(tmp_path / "run"), dict(steps=2, eval_every=0)
    train.train(config(out, str(tmp_path / "data"), stop_after=1, **small))
    shutil.copytree(tmp_path / "data", tmp_path / "moved")  # the same dataset elsewhere (a node's local disk)
    (src / "a.txt").write_text(TEXT.upper())  # the same path, other tokens
    prepare.prepare(str(src), "bytes", tmp_path / "data", val_fraction=0, overwrite=True, progress=False)
    with pytest.raises(ConfigError, match="data differs from the checkpoint's: dataset") as err:
        train.train(config(out, str(tmp_path / "data"), resume=True, **small))
    assert "\n" not in str(err.value)
    assert train.train(config(out, str(tmp_path / "moved"), resume=True, **small))["resumed_from"] == 1
