"""Grade chapter 17's exercises: one BPE merge step, the document mask of a packed batch, and the shard reader's
row arithmetic.

`pytest tests/exercises -k ch17` grades solutions/ (the default); add `--impl exercises` to grade your own answers
(`make grade CH=17`). The oracles: Hugging Face `tokenizers`' BPE trainer (a training loop built from your merge
step must learn its merges), brute-force loops written here (document ids, the mask), per-document
attention (the mask must make packed attention equal to attending each document alone), and numpy slices of the
concatenated shards.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from grading import load
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import minidist.data.corpus

MODULE = "ch17_data"
EOD = 9


# ---------------------------------------------------------------------------------------------------------------
# 1. One BPE merge step
# ---------------------------------------------------------------------------------------------------------------


def test_ch17_most_frequent_pair_counts(impl: str) -> None:
    pick = load(impl, MODULE, "most_frequent_pair")
    ids = {c: i for i, c in enumerate("abcd")}
    got = pick({("a", "a", "a"): 3, ("a", "b"): 5}, ids)
    assert got == ("a", "a"), (
        f"most_frequent_pair: ('a','a','a') x3 holds ('a','a') 6 times, ('a','b') x5 only 5; got {got} — count "
        "overlapping pairs, each as often as its word occurs")
    got = pick({("a", "b", "a", "b"): 1, ("c", "d"): 3}, ids)
    assert got == ("c", "d"), (
        f"most_frequent_pair: ('c','d') occurs 3 times (its word's frequency), ('a','b') twice; got {got} — weight "
        "each pair by the frequency of its word")
    for words in ({("a",): 3, ("bc",): 1}, {}):
        got = pick(words, {**ids, "bc": 4})
        assert got is None, f"most_frequent_pair({words}): no word has two symbols, expected None, got {got}"


def test_ch17_most_frequent_pair_breaks_ties_by_ids(impl: str) -> None:
    pick = load(impl, MODULE, "most_frequent_pair")
    # the ids of merged symbols come after the characters: ("b", "cd") has the smallest ids, not the smallest strings;
    # five pairs tie at 2, placed so that each plausible wrong tie-break picks a different one
    ids = {"a": 0, "b": 1, "c": 2, "d": 3, "cd": 4, "ab": 5, "dd": 6}
    words = {("cd", "a"): 2, ("ab", "c"): 2, ("b", "cd"): 2, ("d", "a"): 2, ("dd", "c"): 2}
    got = pick(words, ids)
    hints = {("cd", "a"): " — that is the first pair seen: `max(pairs, key=pairs.get)` (Sennrich et al.'s reference "
                          "code) keeps the first of a tie; the tokenizers trainer takes the smallest ids",
             ("ab", "c"): " — that is the smallest pair of strings; compare the symbols' ids, not their text",
             ("d", "a"): " — compare the left id first, then the right (a tuple), not their sum nor the right first",
             ("dd", "c"): " — that is the largest (ids[left], ids[right]): take the smallest"}
    assert got == ("b", "cd"), (f"most_frequent_pair: five pairs tie at 2; the smallest (ids[left], ids[right]) is "
                                f"('b','cd') with (1, 4), got {got}{hints.get(got, '')}")


def test_ch17_merge_pair(impl: str) -> None:
    merge = load(impl, MODULE, "merge_pair")
    words = {("a", "a", "a", "a"): 2, ("a", "a", "a"): 1}
    before = dict(words)
    got = merge(words, ("a", "a"))
    assert words == before, "merge_pair changed its input: return a new dict"
    assert got == {("aa", "aa"): 2, ("aa", "a"): 1}, (
        f"merge_pair on ('a','a'): expected ('aa','aa') and ('aa','a'), got {got} — scan from the left and skip "
        "both symbols of a merged pair (occurrences do not overlap)")
    got = merge({("x", "a", "b"): 1, ("xa", "b"): 4}, ("a", "b"))
    assert got == {("x", "ab"): 1, ("xa", "b"): 4}, (
        f"merge_pair: ('xa','b') must stay as it is when merging ('a','b'), got {got} — compare whole symbols, "
        "not text (a string replace of 'a b' also matches 'xa b')")
    got = merge({("a", "b", "c"): 2, ("ab", "c"): 3, ("c",): 1}, ("a", "b"))
    assert got == {("ab", "c"): 5, ("c",): 1}, (
        f"merge_pair: ('a','b','c') x2 becomes ('ab','c'), which ('ab','c') x3 already is: expected one entry with "
        f"5, got {got} — add the frequencies of words that merge into the same symbols")


def _train(impl: str, words: dict[tuple[str, ...], int], n_merges: int) -> list[tuple[str, str]]:
    pick, merge = load(impl, MODULE, "most_frequent_pair"), load(impl, MODULE, "merge_pair")
    ids = {c: i for i, c in enumerate(sorted({c for w in words for c in w}))}
    merges = []
    for _ in range(n_merges):
        try:
            pair = pick(words, ids)
        except KeyError as error:
            pytest.fail(f"most_frequent_pair: the symbol {error} has no id — merge_pair made a symbol other than "
                        "left + right of the merged pair (merge whole symbols, not text)", pytrace=False)
        if pair is None:
            break
        merges.append(pair)
        ids.setdefault(pair[0] + pair[1], len(ids))
        words = merge(words, pair)
    return merges


def test_ch17_bpe_learns_the_merges_of_tokenizers(impl: str) -> None:
    text = Path(minidist.data.corpus.__file__).read_text(encoding="utf-8")
    counts: dict[str, int] = {}
    for word in text.split():
        counts[word] = counts.get(word, 0) + 1
    n_merges = 200
    alphabet = {c for w in counts for c in w}
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(vocab_size=len(alphabet) + n_merges,
                                                              show_progress=False))
    want = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
            for m in json.loads(tokenizer.to_str())["model"]["merges"]]
    got = _train(impl, {tuple(w): n for w, n in counts.items()}, n_merges)
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert got == want, (
        f"BPE from your merge step vs tokenizers' BpeTrainer on {Path(minidist.data.corpus.__file__).name}: "
        f"the merges agree up to #{first}, then yours {got[first:first + 2]} vs {want[first:first + 2]} — "
        "a tie broken another way (smallest ids, left first), or counts that drift after a merge")


# ---------------------------------------------------------------------------------------------------------------
# 2. Document ids, positions and the mask
# ---------------------------------------------------------------------------------------------------------------


def _reference_ids_positions(row: list[int]) -> tuple[list[int], list[int]]:
    doc, pos, ids, positions = 0, 0, [], []
    for token in row:
        ids.append(doc)
        positions.append(pos)
        doc, pos = (doc + 1, 0) if token == EOD else (doc, pos + 1)
    return ids, positions


ROWS = {
    "the docstring's example": [5, 9, 7, 7, 9, 9, 3],
    "EOD at position 0": [9, 1, 2, 3, 4, 5, 6],
    "EOD as the last token": [1, 2, 3, 4, 5, 6, 9],
    "no EOD": [1, 2, 3, 4, 5, 6, 7],
    "only EODs": [9, 9, 9, 9, 9, 9, 9],
}


@pytest.mark.parametrize("case", list(ROWS))
def test_ch17_document_ids_and_positions(impl: str, case: str) -> None:
    fn = load(impl, MODULE, "document_ids_and_positions")
    row = ROWS[case]
    ids, positions = fn(torch.tensor([row]), EOD)
    assert ids.shape == positions.shape == (1, len(row)), f"{case}: expected shapes (1, {len(row)}) for [1, T] tokens"
    want_ids, want_pos = _reference_ids_positions(row)
    got_ids, got_pos = ids[0].tolist(), positions[0].tolist()
    hint = ""
    if got_ids == [i + (t == EOD) for i, t in zip(want_ids, row)]:
        hint = (" — the EOD token has the id of the NEXT document: it is the last token of the one it closes "
                "(count the EODs strictly before a token)")
    elif got_ids and got_ids[0] != 0:
        hint = " — a row's first token is in document 0"
    assert got_ids == want_ids, f"{case}: tokens {row} (EOD {EOD}): ids {got_ids}, expected {want_ids}{hint}"
    hint = ""
    if got_pos == list(range(len(row))) and want_pos != got_pos:
        hint = " — positions must restart at 0 after each EOD"
    elif EOD in row and got_pos[row.index(EOD)] == 0 and want_pos[row.index(EOD)] != 0:
        hint = " — the EOD token closes its document: it takes the next position in it, not 0"
    assert got_pos == want_pos, f"{case}: tokens {row}: positions {got_pos}, expected {want_pos}{hint}"


def test_ch17_document_ids_count_each_row_alone(impl: str) -> None:
    fn = load(impl, MODULE, "document_ids_and_positions")
    rows = [ROWS["the docstring's example"], ROWS["EOD as the last token"], ROWS["EOD at position 0"]]
    ids, positions = fn(torch.tensor(rows), EOD)
    for b, row in enumerate(rows):
        want_ids, want_pos = _reference_ids_positions(row)
        assert ids[b].tolist() == want_ids and positions[b].tolist() == want_pos, (
            f"row {b} of a batch of 3: ids {ids[b].tolist()}, positions {positions[b].tolist()}, expected "
            f"{want_ids}, {want_pos} — each row starts at document 0, position 0 (count along the last dimension, "
            "not over the flattened batch)")


def _reference_mask(ids: list[int]) -> torch.Tensor:
    t = len(ids)
    return torch.tensor([[j <= i and ids[i] == ids[j] for j in range(t)] for i in range(t)])


@pytest.mark.parametrize("case", list(ROWS))
def test_ch17_document_causal_mask(impl: str, case: str) -> None:
    fn = load(impl, MODULE, "document_causal_mask")
    ids = _reference_ids_positions(ROWS[case])[0]
    got = fn(torch.tensor([ids, [0] * len(ids)]))
    t = len(ids)
    assert got.shape == (2, t, t) and got.dtype == torch.bool, (
        f"{case}: expected a bool mask of shape (2, {t}, {t}), got {got.dtype} {tuple(got.shape)}")
    want = _reference_mask(ids)
    same_doc = torch.tensor([[a == b for b in ids] for a in ids])
    hint = ""
    if torch.equal(got[0], want.T):
        hint = " — transposed: mask[b, i, j] is query i (rows) attending key j (columns), j <= i: lower triangle"
    elif torch.equal(got[0], same_doc) and not torch.equal(same_doc, want):
        hint = " — whole document blocks: inside a document the mask is still causal (j <= i)"
    elif torch.equal(got[0], torch.ones(t, t, dtype=torch.bool).tril()) and not torch.equal(got[0], want):
        hint = " — plain causal: a query must not see keys of earlier documents"
    assert torch.equal(got[0], want), f"{case}: doc ids {ids}: wrong mask{hint}\n{got[0].int()}\nexpected\n{want.int()}"
    assert torch.equal(got[1], torch.ones(t, t, dtype=torch.bool).tril()), (
        "a row with one document: the mask must be the causal lower triangle")


def test_ch17_masked_packed_attention_equals_each_document_alone(impl: str) -> None:
    ids_fn, mask_fn = load(impl, MODULE, "document_ids_and_positions"), load(impl, MODULE, "document_causal_mask")
    row = [1, 2, 9, 4, 5, 6, 9, 8, 8, 9, 9, 2, 3]
    ids, _ = ids_fn(torch.tensor([row]), EOD)
    mask = mask_fn(ids)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, len(row), 8, generator=gen) for _ in range(3))
    packed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
    start = 0
    for end in [i + 1 for i, t in enumerate(row) if t == EOD] + [len(row)]:
        if end > start:
            alone = F.scaled_dot_product_attention(q[..., start:end, :], k[..., start:end, :], v[..., start:end, :],
                                                   is_causal=True)
            assert torch.allclose(packed[..., start:end, :], alone, atol=1e-6), (
                f"tokens [{start}, {end}) of {row}: attention under your mask differs from attending that document "
                "alone (causally) — a query sees a key of another document, or misses one of its own")
        start = end


# ---------------------------------------------------------------------------------------------------------------
# 3. The shard reader's row arithmetic
# ---------------------------------------------------------------------------------------------------------------


SHARD_CASES = [
    ("inside one shard", [4, 3, 5], 5, 2, [(1, 1, 3)]),
    ("across three shards", [4, 3, 5], 3, 6, [(0, 3, 4), (1, 0, 3), (2, 0, 2)]),
    ("starting on a boundary", [4, 3, 5], 4, 3, [(1, 0, 3)]),
    ("ending on a boundary", [4, 3, 5], 0, 4, [(0, 0, 4)]),
    ("the whole dataset", [4, 3, 5], 0, 12, [(0, 0, 4), (1, 0, 3), (2, 0, 5)]),
    ("over an empty shard", [4, 0, 3], 2, 4, [(0, 2, 4), (2, 0, 2)]),
    ("the last token", [4, 3, 5], 11, 1, [(2, 4, 5)]),
]


@pytest.mark.parametrize("case", SHARD_CASES, ids=[c[0] for c in SHARD_CASES])
def test_ch17_shard_pieces(impl: str, case: tuple) -> None:
    fn = load(impl, MODULE, "shard_pieces")
    name, shards, start, length, want = case
    got = [tuple(p) for p in fn(list(shards), start, length)]
    hint = ""
    if any(b >= e for _, b, e in got):
        hint = (" — an empty piece: a window that starts or ends on a boundary does not touch the shard beyond it, "
                "and an empty shard is never read")
    elif any(e > shards[k] for k, _, e in got):
        hint = " — begin and end are local to the shard: subtract the tokens of the shards before it"
    elif sum(e - b for _, b, e in got) == length + len(got):
        hint = " — end is exclusive, as in a slice"
    assert got == want, f"shard_pieces({shards}, start={start}, length={length}) ({name}): {got}, expected {want}{hint}"


def test_ch17_shard_pieces_read_the_window(impl: str) -> None:
    fn = load(impl, MODULE, "shard_pieces")
    rng = np.random.default_rng(0)
    sizes = [5, 1, 0, 7, 3, 0, 6]
    shards = [rng.integers(0, 1000, n) for n in sizes]
    whole = np.concatenate(shards)
    for start in range(len(whole)):
        for length in range(1, len(whole) - start + 1):
            pieces = fn(sizes, start, length)
            got = np.concatenate([shards[k][b:e] for k, b, e in pieces])
            assert np.array_equal(got, whole[start:start + length]), (
                f"shard_pieces({sizes}, {start}, {length}) = {pieces}: reading them does not give the window")


@pytest.mark.parametrize("start, length", [(8, 5), (-1, 3), (2, 0), (12, 1)],
                         ids=["past the end", "negative start", "empty window", "starting at the end"])
def test_ch17_shard_pieces_refuses_a_window_outside(impl: str, start: int, length: int) -> None:
    fn = load(impl, MODULE, "shard_pieces")
    try:
        got = fn([4, 3, 5], start, length)
    except ValueError:
        return
    pytest.fail(f"shard_pieces([4, 3, 5], start={start}, length={length}) returned {got}: the 12 tokens do not hold "
                "that window; raise ValueError (a short read here would train on a truncated row)", pytrace=False)

