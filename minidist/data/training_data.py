"""What the trainer trains on, whichever way `--data` names it: a text source (`minidist.data.corpus`: read into
memory as bytes, the byte tokenizer) or a prepared dataset directory (`minidist.data.dataset`: shards read row
by row, the dataset's tokenizer), told apart by the directory's manifest.json.

Either way the run gets two token sources for `BatchSampler` (a tensor or `TokenShards`), the tokenizer's JSON (a
byte run carries one too), its vocabulary and end-of-document id, the unigram entropy of the training split (the
loss of a model that knows only token frequencies; a dataset records it at prepare time, so nothing reads the
whole dataset here), and what identifies the data in a checkpoint: the manifest's and the tokenizer's SHA-256.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from minidist.data.corpus import load_corpus, unigram_entropy_nats
from minidist.data.dataset import is_prepared, open_dataset, read_manifest, read_tokenizer
from minidist.data.sampler import TokenSource
from minidist.data.tokenizer import byte_tokenizer


@dataclass
class TrainingData:
    train: torch.Tensor | TokenSource
    val: torch.Tensor | TokenSource
    description: str
    unigram_entropy_nats: float
    tokenizer_json: bytes
    vocab_size: int
    eod_id: int
    manifest_sha256: str | None  # None for a text source (its path and --max-bytes identify it, as before)

    @property
    def tokenizer_sha256(self) -> str:
        return hashlib.sha256(self.tokenizer_json).hexdigest()

    def identity(self) -> dict[str, str | None]:
        """What a checkpoint records of the data, and a resume must find again."""
        return {"manifest_sha256": self.manifest_sha256, "tokenizer_sha256": self.tokenizer_sha256}


def load_training_data(source: str | None, val_fraction: float = 0.05, max_bytes: int | None = None,
                       verify: bool = True) -> TrainingData:
    """The data `--data` names (module docstring); one-line ValueError for a bad source or dataset. A prepared
    dataset is split and capped by `prepare`: `max_bytes` is refused there, `val_fraction` unused."""
    if source is not None and is_prepared(source):
        check_max_bytes(source, max_bytes)
        ds = open_dataset(source, verify=verify)
        splits = ds.manifest["splits"]
        val = ds.splits.get("val")
        val = val if val is not None else torch.empty(0, dtype=torch.uint8, device="cpu")  # none: no evaluation
        desc = (f"prepared dataset {source} ({ds.manifest['tokenizer'].get('spec', '?')}, vocabulary "
                f"{ds.vocab_size:,}): {ds.manifest.get('source', '?')}")
        entropy = float(splits["train"].get("unigram_entropy_nats", float("nan")))
        return TrainingData(ds.splits["train"], val, desc, entropy, ds.tokenizer_json,
                            ds.vocab_size, ds.eod_id, ds.manifest_sha256)
    corpus = load_corpus(None if source == "stdlib" else source, val_fraction, max_bytes)
    tok = byte_tokenizer()
    return TrainingData(corpus.train, corpus.val, corpus.description, unigram_entropy_nats(corpus.train),
                        tok.json.encode(), tok.vocab_size, tok.eod_id, None)


def check_max_bytes(source: str | None, max_bytes: int | None) -> None:
    """One-line ValueError for `max_bytes` with a prepared dataset: it caps a text source; `prepare` caps a dataset."""
    if max_bytes is not None and is_prepared(source):
        raise ValueError(f"--max-bytes applies to a text source; {source!r} is a prepared dataset (cap it when "
                         "preparing it: python -m minidist.data prepare ... --max-bytes N)")


def data_vocab_size(source: str | None) -> int | None:
    """The vocabulary a prepared dataset's manifest records (a cheap read: no shard is opened); None for a text
    source, whose bytes fit any vocabulary of at least 256."""
    if source is None or not is_prepared(source):
        return None
    return read_manifest(source)[0]["vocab_size"]


def data_tokenizer_json(source: str | None) -> bytes:
    """The tokenizer.json of the data `--data` names (a prepared dataset's, checked; the byte tokenizer's for a
    text source), without opening a shard."""
    if source is not None and is_prepared(source):
        return read_tokenizer(source)
    return byte_tokenizer().json.encode()
