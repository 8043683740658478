"""The run's tokenizer beside the converted weights, so `transformers.AutoTokenizer.from_pretrained(HF_DIR)` loads
it offline with the model.

The trainer writes its tokenizer as RUN_OUT/tokenizer.json (a Hugging Face `tokenizers` JSON, the byte tokenizer's
too). to-hf reads it as untrusted input (a regular file, at most MAX_TOKENIZER_BYTES, parsed by the `tokenizers`
package: JSON, nothing executes), checks that every id it can produce is a row of the model's embedding, and
writes it unchanged with a minimal `tokenizer_config.json` (the fast tokenizer's class, the model's context length,
the end-of-text token when the tokenizer has one of the usual names, found by the rule the trainer's data ends its
documents with; config.json's `eos_token_id` then names it, and `bos_token_id` is null: the trainer adds none). A
run without one (older than its tokenizer file) gets the weights only, and to-hf says so in one line: its tokens
were bytes 0..255.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from minidist.convert.hf_model import ConvertError
from minidist.data.tokenizer import MAX_TOKENIZER_BYTES, find_eod, parse_tokenizer
from minidist.data.training_data import data_tokenizer_json

TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def read_run_tokenizer(run_out: Path, vocab_size: int) -> str | None:
    """RUN_OUT/tokenizer.json's text, checked (see the module); None when the run has none."""
    path = Path(run_out) / TOKENIZER
    if not path.exists() and not path.is_symlink():
        return None
    if not path.is_file():
        raise ConvertError(f"{path} is not a regular file; the trainer writes its tokenizer there as a file")
    text, vocab = _read(path)
    ids = max(vocab.values(), default=-1) + 1  # the largest id, not the number of tokens: ids may have gaps
    if ids > vocab_size:
        raise ConvertError(f"{path} has token ids up to {ids - 1:,} but the model's embedding has {vocab_size:,} "
                           "rows: it is not this run's tokenizer")
    return text


def check_data_tokenizer(hf_dir: Path, data: str | None) -> None:
    """from-hf --data: HF_DIR's tokenizer.json (when it has one) must be the data's (the same token for every id),
    or the model would be fine-tuned on another tokenizer's ids. ConvertError (one line) names the first id that
    differs."""
    path = Path(hf_dir) / TOKENIZER
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_file():
        raise ConvertError(f"{path} is not a regular file")
    try:
        theirs = parse_tokenizer(data_tokenizer_json(data).decode("utf-8", errors="replace"))
    except ValueError as e:
        raise ConvertError(f"--data {data}: {e}") from None
    ours = {i: t for t, i in _read(path)[1].items()}
    data_ids = {i: t for t, i in theirs.get_vocab(with_added_tokens=True).items()}
    differ = sorted(i for i in ours.keys() | data_ids.keys() if ours.get(i) != data_ids.get(i))
    if differ:
        i = differ[0]
        raise ConvertError(f"{path} is not the tokenizer of --data {data or 'stdlib'}: {len(differ):,} ids differ "
                           f"(id {i}: {ours.get(i)!r} here, {data_ids.get(i)!r} in the data); prepare the data with "
                           f"--tokenizer {hf_dir}")


def _read(path: Path) -> tuple[str, dict[str, int]]:
    """A tokenizer.json's text and vocabulary (token -> id, added tokens too), read as untrusted input."""
    if path.stat().st_size > MAX_TOKENIZER_BYTES:
        raise ConvertError(f"{path} is {path.stat().st_size:,} bytes, more than the {MAX_TOKENIZER_BYTES:,} a "
                           "tokenizer.json can be")
    with open(path, "rb") as f:  # bounded even if the file grew since it was measured
        data = f.read(MAX_TOKENIZER_BYTES + 1)
    try:
        text = data.decode("utf-8")
        return text, parse_tokenizer(text).get_vocab(with_added_tokens=True)
    except (UnicodeDecodeError, ValueError) as e:
        raise ConvertError(f"{path} is not a tokenizers JSON: {(str(e).splitlines() or ['unreadable'])[0]}") from None


def end_of_text(text: str) -> tuple[str, int] | None:
    """(token, id) of the tokenizer's end-of-text token, found as the trainer's data finds its end of document
    (`data.tokenizer.find_eod`: the first of EOD_NAMES it holds), or None."""
    return find_eod(parse_tokenizer(text).get_vocab(with_added_tokens=True))


def tokenizer_files(text: str, max_seq_len: int) -> dict[str, bytes]:
    """{file name: bytes} to write beside the weights: the tokenizer.json as it was, and its tokenizer_config.json."""
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_seq_len,
                              "clean_up_tokenization_spaces": False}
    eos = end_of_text(text)
    if eos is not None:
        config["eos_token"] = eos[0]
    return {TOKENIZER: text.encode("utf-8"), TOKENIZER_CONFIG: (json.dumps(config, indent=2) + "\n").encode()}


def special_ids(text: str) -> dict[str, int | None]:
    """config.json's token ids for this tokenizer: its end of text, and no beginning-of-text token (the trainer adds
    none). Without them transformers' Llama would assume Llama 2's 1 and 2, ids this tokenizer gives other tokens."""
    eos = end_of_text(text)
    return {"bos_token_id": None, "eos_token_id": eos[1] if eos is not None else None}
