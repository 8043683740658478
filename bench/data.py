"""The data pipeline's costs: prepare's throughput, the loader's share of a step, a rank's memory against the
dataset's size.

    .venv/bin/python bench/data.py [--mb 20] [--vocab 8192] [--workers N] [--big-gb 1.0] [--steps 20]

- `prepare`: the standard library's .py files (the first --mb MB) tokenized by `python -m minidist.data prepare`
  with --workers processes (default: every core), with a BPE of --vocab ids trained on them once beforehand (the
  training is not timed: prepare is given its tokenizer.json), against `tokenizers`' own `encode_batch` of the same
  documents in this process (its Rust thread pool, every core). Keys: `prepare_tokens_per_s` (wall time of the whole
  prepare: listing, tokenizing, writing shards, hashing), `encode_batch_tokens_per_s`, `ratio` (prepare over
  encode_batch: 1.0 is as fast as the tokenizer alone).
- `loader`: the trainer's default run (model tiny, batch 16 x 128, fp32 on this machine) on the prepared dataset:
  `step_s` (the mean step time the trainer logs after the first step), `loader_s` (one rank's rows of one step read
  from the shards (positional reads) and moved to the device, the mean over --steps * 10 steps), `fraction` (loader_s /
  step_s; the goal is under 1%).
- `memory`: in a fresh process per dataset, `open_dataset` (verify=True, as the trainer opens it: every SHA-256) and
  200 steps of the default batch drawn: `rss_mb` (VmRSS after), `rss_file_mb` (its file-backed part: the shard pages
  touched), `open_s` (the hashing included), for the prepared dataset (`small`, ~10 MB of tokens) and a synthetic one
  of --big-gb GB of random uint16 tokens written into a temporary directory (`big`; only what this bench creates is
  deleted). The goal: the same rss_mb within noise.

Last line: JSON {"prepare": {...}, "loader": {...}, "memory": {"small": {...}, "big": {...}}}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from minidist.data import dataset, prepare, tokenizer
from minidist.data.documents import list_pieces, read_range
from minidist.data.sampler import BatchSampler
from minidist.train import loop as train
from minidist.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def bench_prepare(work: Path, mb: float, vocab: int, workers: int) -> dict:
    listing = list_pieces("stdlib", 0.05, int(mb * 1e6))
    texts = [read_range(p.path, p.start, p.end).decode("utf-8", "replace") for p in listing.train + listing.val]
    tok = tokenizer.train_bpe(texts[: len(listing.train)], vocab)
    (work / "tok").mkdir()
    (work / "tok" / "tokenizer.json").write_text(tok.json)
    rust = tok._rust
    start = time.perf_counter()
    n_ref = sum(len(e.ids) for e in rust.encode_batch(texts, add_special_tokens=False))
    ref_s = time.perf_counter() - start
    start = time.perf_counter()
    m = prepare.prepare("stdlib", str(work / "tok"), work / "small", workers=workers, max_bytes=int(mb * 1e6),
                        progress=False)
    prep_s = time.perf_counter() - start
    tokens = sum(s["tokens"] for s in m["splits"].values())
    eods = sum(s["documents"]["count"] for s in m["splits"].values())
    assert tokens - eods == n_ref, f"prepare wrote {tokens - eods} tokens, encode_batch {n_ref}"
    return {"mb": mb, "vocab": vocab, "workers": workers, "tokens": tokens, "prepare_s": prep_s,
            "encode_batch_s": ref_s, "prepare_tokens_per_s": tokens / prep_s,
            "encode_batch_tokens_per_s": n_ref / ref_s,
            "ratio": (tokens / prep_s) / (n_ref / ref_s)}


def bench_loader(work: Path, steps: int) -> dict:
    cfg = TrainConfig(data=str(work / "small"), steps=steps, log_every=1, eval_every=0, ckpt_every=0,
                      out=str(work / "run"), plot=False, check_every=0)
    summary = train.train(cfg)
    step_s = cfg.batch_size * cfg.seq_len / summary["mean_tokens_per_s"]
    ds = dataset.open_dataset(work / "small")
    sampler = BatchSampler(ds.splits["train"], cfg.seq_len, cfg.batch_size, cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    n = steps * 10
    start = time.perf_counter()
    for step in range(n):
        inputs, targets = sampler.shard(step, 0, 1)
        inputs, targets = inputs.to(device), targets.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
    loader_s = (time.perf_counter() - start) / n
    return {"device": str(device), "step_s": step_s, "loader_s": loader_s, "fraction": loader_s / step_s}


def write_synthetic(root: Path, gb: float) -> None:
    """A dataset of `gb` GB of random uint16 tokens (byte vocabulary ids < 256, one document per 1 MB), hashed."""
    root.mkdir()
    tok = tokenizer.byte_tokenizer()
    (root / "tokenizer.json").write_text(tok.json)
    rng = np.random.default_rng(0)
    shard_tokens, total = 2**27, int(gb * 1e9) // 2
    shards, done = [], 0
    while done < total:
        n = min(shard_tokens, total - done)
        data = rng.integers(0, 256, n, dtype=np.uint16).astype("<u2").tobytes()
        name = f"train_{len(shards):05d}.bin"
        (root / name).write_bytes(data)
        shards.append({"file": name, "tokens": n, "sha256": hashlib.sha256(data).hexdigest()})
        done += n
    ends = np.arange(2**19, total, 2**19, dtype="<i8").tolist() + [total]
    index = np.asarray(ends, dtype="<i8").tobytes()
    (root / "train_docs.bin").write_bytes(index)
    manifest = {"format": prepare.FORMAT, "version": prepare.VERSION, "dtype": "uint16", "vocab_size": tok.vocab_size,
                "eod_id": tok.eod_id,
                "tokenizer": {"file": "tokenizer.json", "spec": "bytes",
                              "sha256": hashlib.sha256(tok.json.encode()).hexdigest()},
                "source": "synthetic", "splits": {"train": {"tokens": total, "shards": shards, "documents": {
                    "file": "train_docs.bin", "count": len(ends), "sha256": hashlib.sha256(index).hexdigest()}}}}
    (root / "manifest.json").write_text(json.dumps(manifest))


def rank_memory(root: str) -> dict:
    """Run in a fresh process: open the dataset as the trainer does, draw 200 default batches, report memory."""
    start = time.perf_counter()
    ds = dataset.open_dataset(root, verify=True)
    open_s = time.perf_counter() - start
    sampler = BatchSampler(ds.splits["train"], 128, 16, 0)
    for step in range(200):
        sampler.shard(step, 0, 1)
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kb = {k: int(status[k].split()[0]) for k in ("VmRSS", "RssFile")}
    size = sum(p.stat().st_size for p in Path(root).iterdir())
    return {"dataset_mb": size / 1e6, "rss_mb": kb["VmRSS"] / 1024, "rss_file_mb": kb["RssFile"] / 1024,
            "open_s": open_s}


def measure_in_process(root: Path) -> dict:
    code = f"import json, sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import data; " \
           f"print(json.dumps(data.rank_memory({str(root)!r})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=20.0, help="MB of the standard library to prepare")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--big-gb", type=float, default=1.0, help="GB of the synthetic dataset (at least 1)")
    parser.add_argument("--steps", type=int, default=20, help="trainer steps timed for the loader's share")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="minidist-bench-data-") as tmp:  # deleted with everything in it
        work = Path(tmp)
        results = {"prepare": bench_prepare(work, args.mb, args.vocab, args.workers)}
        print("prepare", results["prepare"], flush=True)
        results["loader"] = bench_loader(work, args.steps)
        print("loader", results["loader"], flush=True)
        write_synthetic(work / "big", args.big_gb)
        results["memory"] = {"small": measure_in_process(work / "small"), "big": measure_in_process(work / "big")}
        print("memory", results["memory"], flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
