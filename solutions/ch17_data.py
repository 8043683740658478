"""Chapter 17 exercises: one merge step of byte-pair encoding, the document mask of a packed batch, and the row
arithmetic of a sharded token reader.

Grade your answers with `make grade CH=17`. The grader checks:
  - most_frequent_pair / merge_pair: pairs counted over a word-frequency table (a word counts as often as it
    occurs, overlapping pairs too: "aaa" holds two (a, a)), ties broken by the smaller token ids, "aaaa" merged
    left to right into ("aa", "aa"), words that merge into the same symbols added up; a whole training loop built
    from your two functions learns exactly the merges of Hugging Face `tokenizers`' BPE trainer;
  - document_ids_and_positions / document_causal_mask: an end-of-document token (EOD) is the LAST token of the
    document it closes; EOD at position 0, at the end, twice in a row, or absent; every row of a batch on its own;
  - shard_pieces: a window inside one shard, starting or ending exactly on a boundary (no empty pieces), spanning
    three shards, skipping empty shards, and a window past the end refused with a ValueError.
"""

import torch


def most_frequent_pair(words: dict[tuple[str, ...], int], ids: dict[str, int]) -> tuple[str, str] | None:
    """The adjacent pair of symbols that occurs most often over a word-frequency table, or None if no word has two.

    `words` maps each word, split into its current symbols, to how often it occurs in the corpus: {("l", "o", "w"):
    5, ("l", "o", "w", "e", "r"): 2} is "low" five times and "lower" twice. Every adjacent pair inside a word counts
    that word's frequency, overlapping pairs included (("a", "a", "a"), 3) counts ("a", "a") six times: Sennrich,
    Haddow and Birch 2016 count this way, and so does the `tokenizers` trainer.

    Ties: among pairs with the highest count, return the one whose (ids[left], ids[right]) is smallest, comparing
    the left symbol's id first. `ids` numbers every symbol in the order the vocabulary got it (the single
    characters first, sorted, then each merged symbol as it was created); this is the rule of the `tokenizers`
    trainer, so that your merges match it exactly.

    Hints: a Counter of pairs; min over (-count, id of left, id of right).
    """
    counts: dict[tuple[str, str], int] = {}
    for word, freq in words.items():
        for pair in zip(word, word[1:]):
            counts[pair] = counts.get(pair, 0) + freq
    if not counts:
        return None
    return min(counts, key=lambda p: (-counts[p], ids[p[0]], ids[p[1]]))


def merge_pair(words: dict[tuple[str, ...], int], pair: tuple[str, str]) -> dict[tuple[str, ...], int]:
    """The word-frequency table after replacing every occurrence of `pair` by one symbol, left + right.

    Scan each word from the left: where the next two symbols are the pair, emit the merged symbol and skip both;
    otherwise emit one symbol and move on. So ("a", "a", "a", "a") merged on ("a", "a") becomes ("aa", "aa") and
    ("a", "a", "a") becomes ("aa", "a"). Only whole symbols merge: ("xa", "b") stays as it is for the pair
    ("a", "b"). Two words may become the same sequence of symbols (("a", "b", "c") and ("ab", "c") are both
    ("ab", "c") after merging ("a", "b")): add their frequencies. Return a new dict; leave `words` unchanged.

    Hints: a while loop over the index of each word, stepping by 2 after a merge and by 1 otherwise.
    """
    left, right = pair
    merged: dict[tuple[str, ...], int] = {}
    for word, freq in words.items():
        out, i = [], 0
        while i < len(word):
            if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
                out.append(left + right)
                i += 2
            else:
                out.append(word[i])
                i += 1
        key = tuple(out)
        merged[key] = merged.get(key, 0) + freq
    return merged


def document_ids_and_positions(tokens: torch.Tensor, eod_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's document index in its row, and its position inside that document; both int64, tokens' shape.

    `tokens` is a packed batch [B, T]: documents joined end to end, each closed by the end-of-document token
    `eod_id`, and cut into rows wherever the window fell. The EOD token is the LAST token of the document it
    closes, so it has its document's id, and the token after it starts the next document (id + 1, position 0).
    Each row counts on its own: its first token has document 0 and position 0 (a window cut in the middle of a
    document starts that document's positions again at 0; the model cannot see the part before the window anyway).

    Example, eod_id = 9: tokens [5, 9, 7, 7, 9, 9, 3] → ids [0, 0, 1, 1, 1, 2, 3], positions [0, 1, 0, 1, 2, 0, 0].

    Hints: a document id is the number of EOD tokens strictly before the token (a cumulative sum, minus the token
    itself); a position is the token's index minus the index where its document starts (cummax carries the start
    forward).
    """
    is_eod = (tokens == eod_id).long()
    doc_ids = is_eod.cumsum(-1) - is_eod
    index = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(index)
    starts[..., 1:] = torch.where(is_eod[..., :-1].bool(), index[..., 1:], 0)
    return doc_ids, index - starts.cummax(-1).values


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed rows: query i may attend to key j iff j <= i and both are in one document.

    `doc_ids` is [B, T] (from `document_ids_and_positions`); return a bool tensor [B, T, T] with mask[b, i, j]
    True where query i of row b attends key j. Within a document it is the causal (lower-triangular) mask; across
    documents it is False: block-diagonal causal (Llama 3's document mask). True means "attend", as in SDPA's
    attn_mask.

    Hints: compare the ids of every query with those of every key by broadcasting ([B, T, 1] against [B, 1, T]).
    """
    t = doc_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=doc_ids.device).tril()
    return (doc_ids[..., :, None] == doc_ids[..., None, :]) & causal


def shard_pieces(shard_tokens: list[int], start: int, length: int) -> list[tuple[int, int, int]]:
    """Where the tokens [start, start + length) of a dataset split into shards lie: (shard, begin, end) pieces.

    The dataset is the shards' tokens end to end: shard k holds `shard_tokens[k]` tokens, and global token g lies
    in shard k at local index g − (tokens of shards 0..k−1). Return, in order, one (k, begin, end) per shard the
    window touches, with begin < end local indices (the window's tokens are shard k's [begin, end)): reading those
    slices and concatenating them gives the window. No empty pieces: a window that starts or ends exactly on a
    boundary does not touch the shard beyond it, and an empty shard (0 tokens) is never a piece.

    Raise ValueError (one line) if length < 1, start < 0, or the window runs past the last token.

    Example: shard_tokens [4, 3, 5], start 3, length 6 → [(0, 3, 4), (1, 0, 3), (2, 0, 2)].

    Hints: walk the shards keeping the global index of each one's first token; the window's overlap with shard k is
    an intersection of two half-open intervals, empty when its begin is not below its end.
    """
    total = sum(shard_tokens)
    if length < 1 or start < 0 or start + length > total:
        raise ValueError(f"window [{start}, {start + length}) does not fit in {total} tokens; need 0 <= start and "
                         f"1 <= length with start + length <= {total}")
    pieces, first, stop = [], 0, start + length
    for k, n in enumerate(shard_tokens):
        begin, end = max(start, first), min(stop, first + n)
        if begin < end:
            pieces.append((k, begin - first, end - first))
        first += n
    return pieces

