"""The trainer with --doc-mask (issue 28): the one-process run scores each document as if it ran alone (its first
loss against the model run document by document), differs from the run without the mask, and every layout of two
ranks (dp + ZeRO, tp + sp, pp interleaved, cp ring / all-gather / Ulysses, zig-zag where it is the default) logs
its losses, gradient norms and validation losses (pp 1F1B with --doc-mask: tests/test_device_sentinel.py). One
launch of 2 ranks runs every layout."""

import functools
import random
from pathlib import Path

import pytest
import torch
import trainer_parity

from minidist import flops
from minidist.comm.launch import run_ranks
from minidist.data.sampler import BatchSampler
from minidist.model import build_model, lm_loss
from minidist.model.documents import attention_pairs, document_ids
from minidist.train import loop as train
from minidist.train.config import TrainConfig, model_config

MODEL = {"n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "max_seq_len": 64}

LAYOUTS = {
    "dp2 zero1": dict(dp=2, zero=1),
    "tp2 sp": dict(tp=2, sp=True),
    "pp2 interleaved": dict(pp=2, schedule="interleaved", virtual_stages=2),
    "cp2 ring": dict(cp=2, cp_impl="ring"),  # zig-zag: rank r holds chunks r and 3 − r
    "cp2 allgather": dict(cp=2, cp_impl="allgather"),
    "cp2 ulysses": dict(cp=2, cp_impl="ulysses"),  # contiguous, the whole sequence per head group
}


def write_documents(root: Path) -> Path:
    """Short documents (3 to 20 bytes), so that every row of 32 tokens crosses several boundaries."""
    docs, rng = root / "docs", random.Random(0)
    docs.mkdir(exist_ok=True)
    words = "the of and to in is that for it as with was on be by this are from at or".split()
    for i in range(240):
        (docs / f"{i:03d}.txt").write_text(" ".join(rng.choice(words) for _ in range(rng.randint(1, 3))) + ".")
    return docs


def config(out: str, **changes) -> TrainConfig:
    """3 steps of batch 8 x 32 in 2 micro-batches, clipping active, 2 evaluations, documents beside OUT."""
    settings = dict(model="tiny", model_overrides=dict(MODEL), data=str(Path(out).parent / "docs"), batch_size=8,
                    seq_len=32, microbatches=2, steps=3, warmup_steps=1, grad_clip=1.0, eval_every=2,
                    eval_batches=2, log_every=100, ckpt_every=0, out=out, seed=0, peak_flops=1e12, plot=False,
                    doc_mask=True)
    return TrainConfig(**{**settings, **changes})


def _rank_layouts(root: str) -> dict:
    return trainer_parity.train_layouts(root, LAYOUTS, config)


@functools.lru_cache(maxsize=1)
def _results(root: str) -> list[dict]:
    write_documents(Path(root))
    return run_ranks(_rank_layouts, 2, root, timeout=600, threads_per_rank=1)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    return _results(str(tmp_path_factory.mktemp("doc_layouts")))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("doc_single")
    write_documents(root)
    return root


@pytest.fixture(scope="module")
def reference(root) -> list[dict]:
    return trainer_parity.single_process_records(str(root / "masked"), config)


@pytest.fixture(scope="module")
def step_flops(root) -> dict[int, float]:
    """Each step's model FLOPs with the attention pairs its documents keep, counted over the global batch."""
    cfg = config(str(root / "masked"))
    corpus = train.load_data(cfg)
    sampler = BatchSampler(corpus.train, cfg.seq_len, cfg.batch_size, cfg.seed)
    eod = corpus.eod_id
    return {step: flops.step_flops(model_config(cfg), cfg.batch_size * cfg.seq_len,
                                   int(attention_pairs(document_ids(sampler.batch(step)[0], eod))))
            for step in range(cfg.steps)}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_logs_the_single_process_run(name, results, reference, step_flops) -> None:
    records = results[0][name]["records"]
    trainer_parity.assert_logs_match(name, records, reference)
    for r in results:
        assert r[name]["losses"] == results[0][name]["losses"]
    for record in records:  # MFU from the pairs of the whole global batch (dp ranks sum their own rows' counts)
        assert record["mfu"] == pytest.approx(step_flops[record["step"]] / record["step_s"] / (2 * 1e12), rel=1e-9)


def test_first_loss_is_each_document_alone(root, reference) -> None:
    """Step 0's loss is the model's (seed 0) loss on each document run alone, the targets still the next tokens
    (an EOD's target is the next document's first token), and differs from the run without the mask."""
    cfg = config(str(root / "masked"))
    corpus = train.load_data(cfg)
    inputs, targets = BatchSampler(corpus.train, cfg.seq_len, cfg.batch_size, cfg.seed).batch(0)
    ids = document_ids(inputs, corpus.eod_id)
    model, total = build_model(model_config(cfg), seed=cfg.seed), 0.0
    with torch.no_grad():
        for row in range(inputs.shape[0]):
            for doc in ids[row].unique():
                where = (ids[row] == doc).nonzero().flatten()
                total += float(lm_loss(model(inputs[row:row + 1, where]), targets[row:row + 1, where], reduction="sum"))
    assert (ids.max(dim=1).values >= 2).all()  # every row holds at least three documents
    assert reference[0]["loss"] == pytest.approx(total / inputs.numel(), rel=1e-5)
    plain = trainer_parity.single_process_records(str(root / "plain"), functools.partial(config, doc_mask=False))
    assert abs(plain[0]["loss"] - reference[0]["loss"]) > 1e-3


def test_mfu_counts_the_attention_kept(root, reference, step_flops) -> None:
    """The logged MFU of a --doc-mask step uses the pairs its documents keep, not the causal T·(T+1)/2."""
    cfg = config(str(root / "masked"))
    causal = flops.step_flops(model_config(cfg), cfg.batch_size * cfg.seq_len,
                              cfg.batch_size * cfg.seq_len * (cfg.seq_len + 1) // 2)
    for record in reference:
        assert step_flops[record["step"]] < causal
        assert record["mfu"] == pytest.approx(step_flops[record["step"]] / record["step_s"] / cfg.peak_flops, rel=1e-9)
