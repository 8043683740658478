"""Tokenizers a dataset can be prepared with, all through Hugging Face's `tokenizers` package (offline):

- ``bytes`` (the default, chapter 01's): a token is a UTF-8 byte, vocabulary 256, end of document 0x1C (the file
  separator `corpus.FILE_SEPARATOR` already placed between files). Its `tokenizer.json` is a byte-level BPE without
  merges whose ids are the byte values, so a dataset and a run carry one like any other and `transformers` loads it.
- ``bpe:VOCAB``: a byte-level BPE trained on the corpus being prepared, on this machine, with the end-of-document
  token ``<|endoftext|>`` as id 0. If the corpus runs out of merges first (a small corpus), the vocabulary is padded
  with reserved special tokens ``<|reserved_N|>`` to exactly VOCAB, as Llama 3 reserves some: the model's shape is
  the one asked for. Determinism: `tokenizers` 0.23.3 trained the same JSON, byte for byte, twice in a row and with
  RAYON_NUM_THREADS 1, 2, 3, 8 and 16 (measured on the standard library's email/json/asyncio packages;
  tests/test_prepare.py trains with 1 and 4 threads in fresh processes); the trained tokenizer is anyway written
  into the dataset and is the input of every later step (the trainer reads the dataset's tokenizer.json, it never
  trains one), so a dataset stays reproducible from its own files.
- a path to a ``tokenizer.json``, or to a directory holding one (a Hugging Face model directory): used as it is. Its
  end-of-document token is the first of `EOD_NAMES` it holds (or the one named with `eod_token=`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from minidist.data.documents import read_range

BYTE_EOD_ID = 0x1C  # corpus.FILE_SEPARATOR[0]
EOD_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizers, in the order they are looked for in a loaded tokenizer.json.
EOD_NAMES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")
MAX_TOKENIZER_BYTES = 256 * 2**20  # a tokenizer.json is read whole: refuse one bigger than any real one
# The largest vocabulary (ids 0..MAX_VOCAB-1): 2**18 = 262,144, Gemma 3's, the largest of the usual tokenizers
# (Llama 3: 128,256). bpe:2**18 pads a small corpus in ~4 s to a 34 MB tokenizer.json; a larger one would be
# minutes and an embedding no run here trains, and an id of 4e9 would ask for a 30 GiB count table.
MAX_VOCAB = 2**18
# A normalizer may lengthen text (NFKC turns one character into at most 18); more than this many characters out
# per character in is refused: a Replace normalizer turning each character into 5,000 would multiply the memory
# of every piece it tokenizes.
MAX_EXPANSION = 32
_PROBE = "".join(map(chr, range(32, 0x250))) + "\n\t ﷺ가各ａ①"  # the probe text the normalizer is run on


@dataclass(frozen=True)
class TextTokenizer:
    """A tokenizer as a dataset records it: its JSON (the `tokenizers` format), vocabulary size and EOD id."""

    spec: str  # how it was asked for: "bytes", "bpe:4096", or the path it was read from
    json: str
    vocab_size: int
    eod_id: int

    @property
    def is_bytes(self) -> bool:
        return self.spec == "bytes"

    @property
    def dtype(self) -> np.dtype:
        """The smallest shard dtype of the contract that holds every id."""
        return np.dtype("<u2") if self.vocab_size <= 2**16 else np.dtype("<u4")

    @functools.cached_property
    def _rust(self):  # noqa: ANN202 (the `tokenizers` object, built once per process)
        from tokenizers import Tokenizer
        return Tokenizer.from_str(self.json)

    def encode(self, data: bytes) -> np.ndarray:
        """Token ids of `data` (a document's bytes), in `self.dtype`. Bytes: the identity (invalid UTF-8 kept as it
        is); otherwise the text decoded as UTF-8, an invalid sequence replaced by U+FFFD."""
        if self.is_bytes:
            return np.frombuffer(data, dtype=np.uint8).astype(self.dtype)
        ids = self._rust.encode(bytes(data).decode("utf-8", errors="replace"), add_special_tokens=False).ids
        return np.asarray(ids, dtype=self.dtype)

    def decode(self, ids: Iterable[int]) -> str:
        return self._rust.decode([int(i) for i in ids], skip_special_tokens=False)


def _byte_to_char() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte a printable character (what `tokenizers`' ByteLevel maps bytes to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    rest = [b for b in range(256) if b not in printable]
    chars = printable + [256 + i for i in range(len(rest))]
    return {b: chr(c) for b, c in zip(printable + rest, chars)}


@functools.lru_cache(maxsize=1)
def byte_tokenizer() -> TextTokenizer:
    """The byte tokenizer as a `tokenizers` JSON: id = byte value, no merges, EOD = 0x1C."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = _byte_to_char()
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return TextTokenizer("bytes", tok.to_str(), 256, BYTE_EOD_ID)


def train_bpe(texts: Iterable[str], vocab_size: int) -> TextTokenizer:
    """A byte-level BPE of `vocab_size` ids trained on `texts` (EOD `<|endoftext|>` = id 0; padded with reserved
    special tokens if the texts run out of merges first)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    if not 257 <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"bpe vocabulary {vocab_size:,} is out of range; a byte-level BPE needs 257 (256 bytes and "
                         f"the end-of-document token) to {MAX_VOCAB:,} ids")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    short = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if short > 0:
        tok.add_special_tokens([AddedToken(f"<|reserved_{i}|>", special=True) for i in range(short)])
    return TextTokenizer(f"bpe:{vocab_size}", tok.to_str(), vocab_size, tok.token_to_id(EOD_TOKEN))


def parse_bpe_spec(spec: str) -> int | None:
    """VOCAB of a ``bpe:VOCAB`` spec, None for any other spec."""
    if not spec.startswith("bpe:"):
        return None
    try:
        return int(spec[4:])
    except ValueError:
        raise ValueError(f"tokenizer {spec!r}: VOCAB must be an integer, e.g. bpe:32768") from None


def load_tokenizer_json(path: str | Path, eod_token: str | None = None, spec: str | None = None) -> TextTokenizer:
    """A tokenizer.json (or a directory holding one), read as untrusted input: one-line ValueError when it is not
    a regular file, too big, not a `tokenizers` JSON, or has no end-of-document token."""
    path = Path(path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"tokenizer {str(path)!r} is not a regular file; pass 'bytes', 'bpe:VOCAB', a tokenizer.json "
                         "or a model directory holding one")
    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        raise ValueError(f"tokenizer {str(path)!r} is {path.stat().st_size:,} bytes, over the "
                         f"{MAX_TOKENIZER_BYTES:,} a tokenizer.json can be")
    text = path.read_bytes()[:MAX_TOKENIZER_BYTES].decode("utf-8", errors="replace")
    try:
        tok = parse_tokenizer(text)
    except ValueError as e:
        raise ValueError(f"tokenizer {str(path)!r} is not a tokenizers JSON: {str(e)[:200]}") from None
    return from_tokenizer(tok, text, spec or str(path), eod_token)


def parse_tokenizer(text: str) -> Any:
    """The `tokenizers.Tokenizer` of a tokenizer.json's text; ValueError (one line) when it is not one."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # the Rust parser raises a bare Exception for a malformed file
        raise ValueError((str(e).splitlines() or [type(e).__name__])[0]) from None


def from_tokenizer(tok, text: str, spec: str, eod_token: str | None = None) -> TextTokenizer:  # noqa: ANN001
    """A loaded `tokenizers.Tokenizer` (`tok`, from JSON `text`) with its vocabulary size and EOD id."""
    if text == byte_tokenizer().json:
        return byte_tokenizer()
    vocab = tok.get_vocab(with_added_tokens=True)
    check_bounds(tok, vocab, spec, text)
    eod = find_eod(vocab, eod_token)
    if eod is None:
        names = (eod_token,) if eod_token is not None else EOD_NAMES
        raise ValueError(f"tokenizer {spec!r} has no end-of-document token (looked for {', '.join(names)}); "
                         "name one that it has with --eod-token")
    return TextTokenizer(spec, text, max(vocab.values()) + 1, eod[1])


def check_bounds(tok, vocab: Mapping[str, int], spec: str, text: str) -> None:  # noqa: ANN001 (a `tokenizers.Tokenizer`)
    """One-line ValueError for a tokenizer whose largest id is MAX_VOCAB or more, or whose normalizer makes text
    more than MAX_EXPANSION times longer: a Replace of the JSON (`text`) whose content is that much longer than
    what it replaces, or any normalizer on a probe text, before any data is tokenized."""
    top = max(vocab.values(), default=-1)
    if top >= MAX_VOCAB:
        raise ValueError(f"tokenizer {spec!r} has token id {top:,}; ids must be below {MAX_VOCAB:,} (the largest "
                         "vocabulary minidist trains)")
    expanding = f"tokenizer {spec!r}: its normalizer makes text more than {MAX_EXPANSION} times longer; refused " \
                "(it would multiply the memory of everything it tokenizes)"
    if any(_replace_ratio(r) > MAX_EXPANSION for r in _replaces(json.loads(text).get("normalizer"))):
        raise ValueError(expanding)
    if tok.normalizer is not None:
        for i in range(0, len(_PROBE), 64):  # in short probes: an expanding normalizer is stopped early
            piece = _PROBE[i:i + 64]
            if len(tok.normalizer.normalize_str(piece)) > MAX_EXPANSION * len(piece):
                raise ValueError(expanding)


def _replaces(node: object) -> Iterator[dict]:
    """Every Replace normalizer in a normalizer's JSON (Sequences nest them)."""
    if isinstance(node, dict):
        if node.get("type") == "Replace":
            yield node
        for value in node.values():
            yield from _replaces(value)
    elif isinstance(node, list):
        for value in node:
            yield from _replaces(value)


def _replace_ratio(node: dict) -> float:
    """Characters out per character in of one Replace (a regex may match a single character)."""
    pattern, content = node.get("pattern"), node.get("content")
    literal = pattern.get("String") if isinstance(pattern, dict) else None
    width = len(literal) if isinstance(literal, str) and literal else 1
    return len(content) / width if isinstance(content, str) else 0.0


def vocab_of(tokenizer_json: bytes | str) -> int:
    """The number of ids (largest + 1) of a tokenizer.json's text; one-line ValueError when it is not one."""
    text = tokenizer_json.decode("utf-8", errors="replace") if isinstance(tokenizer_json, bytes) else tokenizer_json
    if text == byte_tokenizer().json:
        return 256
    return max(parse_tokenizer(text).get_vocab(with_added_tokens=True).values(), default=-1) + 1


def find_eod(vocab: Mapping[str, int], eod_token: str | None = None) -> tuple[str, int] | None:
    """(token, id) of the end-of-document token in `vocab` (token -> id, added tokens included): `eod_token` when
    given, else the first of EOD_NAMES it holds; None when it holds none. The one rule for the trainer's data and
    for what `convert to-hf` names as the end of text."""
    names = (eod_token,) if eod_token is not None else EOD_NAMES
    return next(((name, vocab[name]) for name in names if name in vocab), None)


def resolve_tokenizer(spec: str, texts: Iterable[str] | None = None, eod_token: str | None = None) -> TextTokenizer:
    """The tokenizer a spec names (module docstring); `texts` is the corpus a ``bpe:`` spec is trained on."""
    if spec == "bytes":
        return byte_tokenizer()
    vocab = parse_bpe_spec(spec)
    if vocab is not None:
        if texts is None:
            raise ValueError(f"tokenizer {spec!r} is trained on a corpus: pass the texts")
        return train_bpe(texts, vocab)
    return load_tokenizer_json(spec, eod_token)


# Worker side of `minidist.data.prepare`: this module imports no torch, so a spawned worker starts fast.
_WORKER_TOKENIZER: TextTokenizer | None = None


def worker_init(tok: TextTokenizer) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = tok


def worker_encode(piece: tuple[str, int, int]) -> np.ndarray:
    """The ids of bytes [start, end) of a file, with the tokenizer `worker_init` gave this process."""
    return _WORKER_TOKENIZER.encode(read_range(*piece))
