"""Chapter 10 exercises: merge two partial attention results with the online softmax, and split a sequence over
context-parallel ranks zig-zag (and put it back together).

Grade your answers with `make grade CH=10`. The grader checks, against the chapter's own numbers:
  - merge_partials on random blocks (fp64) equals softmax attention over the union of the keys, computed directly;
    also when the scores are huge (exp would overflow), when one block saw no key at all (log-sum-exp −inf), and
    when both did;
  - zigzag_shard_index gives the chapter's table (T = 16, cp = 4: rank 1 holds [2, 3, 12, 13]) and, for other
    sizes, a split where every rank holds T/cp positions and does the same causal work;
  - zigzag_unshard_index puts the ranks' shards, laid end to end, back into sequence order;
  - ring_attention, on 3 real ranks (one launch for all cases), equals causal scaled-dot-product attention over the
    gathered sequence at every rank's zig-zag positions, for several shapes and for huge scores, with K/V moving
    only between ring neighbours (no all-gather);
  - ulysses_attention, in the same launch, equals causal SDPA on the gathered sequence at every rank's positions,
    forward and gradients of q, k and v.
"""

import torch
import torch.distributed as dist  # noqa: F401  (ring_attention passes K/V with dist.batch_isend_irecv)


def merge_partials(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                   lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention over key set A and attention over a disjoint key set B into attention over A ∪ B.

    Inputs: `out_a` [..., T, d] is softmax(S_A) V_A, normalized over the keys of A only, and `lse_a` [..., T] is
    the log-sum-exp of each query's scores over A: L_A = log Σ_{j∈A} exp(s_j). The same for B. Return
    (out, lse) over A ∪ B, without the scores (they are gone: that is the point of the online softmax).

    The derivation (chapter 10, §2; Milakov & Gimelshein 2018): the softmax over A ∪ B divides by
    Σ_{A∪B} e^s = e^{L_A} + e^{L_B} = e^L, and out_A was divided by e^{L_A}, so
        L   = log(e^{L_A} + e^{L_B})
        out = e^{L_A − L} · out_A + e^{L_B − L} · out_B        (the two weights sum to 1)

    Hints:
      - Never compute e^{L_A} itself: scores of 1000 overflow. torch.logaddexp(a, b) computes L stably, and
        L_A − L ≤ 0, so e^{L_A − L} is in [0, 1].
      - A block in which a query saw no key at all (a fully masked row) has L = −inf and out = 0; its weight must
        be exactly 0. If *both* are −inf, L is −inf and L_A − L is NaN: return out = 0 and lse = −inf there.
      - The weights have shape [..., T]; out has [..., T, d]: add a trailing dimension to broadcast.
    """
    raise NotImplementedError("exercise: merge two partial attention results with the online softmax")


def zigzag_shard_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions of the tokens rank `rank` of `cp` holds under the zig-zag split, in the order it holds
    them (an int64 tensor of seq_len / cp positions).

    Under a causal mask, query t scores t + 1 keys, so a contiguous split (rank r holds [r·T/cp, (r+1)·T/cp))
    gives the last rank about 2·cp − 1 times the work of the first. The zig-zag split (Llama 3, §3.3.2) cuts the
    sequence into 2·cp equal chunks of c = T/(2·cp) tokens and gives rank r chunks r and 2·cp − 1 − r: one cheap
    chunk from the start and one expensive chunk from the end, the same total for every rank.

    Example (T = 16, cp = 4, c = 2): rank 0 holds [0, 1, 14, 15], rank 1 [2, 3, 12, 13], rank 2 [4, 5, 10, 11],
    rank 3 [6, 7, 8, 9]. Chunk r comes first, then chunk 2·cp − 1 − r, each in increasing order.
    You may assume seq_len is divisible by 2·cp.
    """
    raise NotImplementedError("exercise: the positions of rank `rank`'s two zig-zag chunks")


def zigzag_unshard_index(seq_len: int, cp: int) -> torch.Tensor:
    """The inverse of the split: an index `inv` (int64, seq_len entries) such that, if `held` is every rank's
    shard laid end to end (rank 0's tokens, then rank 1's, ...), `held[inv]` is the sequence in order.

    Ulysses attention (chapter 10, §5) receives exactly such a `held` sequence after its all-to-all and must put
    it back into causal order before attending; the all-gather variant could do the same to its gathered keys.

    Example (T = 16, cp = 4): held positions are [0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]; position
    2 sits in slot 4, so inv[2] = 4, and inv = [0, 1, 4, 5, 8, 9, 12, 13, 14, 15, 10, 11, 6, 7, 2, 3].

    Hints: build `held` from zigzag_shard_index for every rank; you want, for each position p, the slot i with
    held[i] = p. That is the inverse permutation, which torch.argsort gives (or fill inv[held] = arange(T)).
    """
    raise NotImplementedError("exercise: the inverse permutation of the zig-zag split")


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Causal attention for this rank's queries over the whole sequence, with K/V passed around a ring of ranks.

    Every rank of the default process group (cp = world size) calls this with its own shard under the zig-zag
    split: q, k, v are [B, H, seq_len / cp, d], holding positions zigzag_shard_index(seq_len, cp, rank) in that
    order. Return [B, H, seq_len / cp, d]: softmax(q Kᵀ / √d + causal mask) V over all seq_len keys, for this
    rank's queries — what SDPA with is_causal=True gives on the gathered sequence, at this rank's positions.

    The algorithm (chapter 10, §2-3; Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for
    Near-Infinite Context"): cp steps. At each step a rank attends its queries to the K/V block it holds, folds the
    partial result into running (out, lse) accumulators with the online softmax, and passes the block to its ring
    neighbour while receiving the next one. After cp steps every query has seen every key, and no rank ever held
    more than two K/V blocks.

    Hints:
      - Which positions does the block you hold now belong to? It started on another rank; count the hops. Its
        positions under the zig-zag split decide the causal mask (a key is visible when its position ≤ the query's).
      - A block can be entirely invisible to this rank's queries; a row of a block can be too. Your merge_partials
        already handles a −inf log-sum-exp; a block no query can see need not be computed at all.
      - Send and receive in the same step (dist.P2POp with dist.isend / dist.irecv, then dist.batch_isend_irecv):
        a blocking send to a neighbour that is itself blocked sending deadlocks. Wait before using the new block.
      - Start the accumulators at out = 0 and lse = −inf: the empty set of keys.
    """
    raise NotImplementedError("exercise: ring attention with online-softmax accumulators over zig-zag shards")


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention for this rank's tokens by Ulysses' head exchange, differentiable end to end.

    Every rank of the default process group (cp = world size) calls this with the *contiguous* split: q, k, v are
    [B, H, seq_len / cp, d] holding positions [rank·T/cp, (rank + 1)·T/cp); H is divisible by cp. Return
    [B, H, seq_len / cp, d], the causal attention output for this rank's tokens — and gradients that reach q, k
    and v correctly when the caller back-propagates.

    The algorithm (chapter 10, §5; Jacobs et al. 2023, "DeepSpeed Ulysses", §3): one all-to-all turns "all heads
    of my T/cp tokens" into "H/cp of the heads for all T tokens", attention runs as ordinary full-sequence causal
    attention (torch's SDPA with is_causal=True), and a second all-to-all turns the output back.

    Hints:
      - dist.all_to_all_single exchanges equal chunks of the first dimension: chunk j goes to rank j, and the
        output's chunk i came from rank i. Arrange the tensor so that the first dimension is the destination.
      - Under the contiguous split, rank i's tokens are positions i·T/cp onwards: laying the received chunks end to
        end in rank order *is* the causal order.
      - Autograd cannot see through a collective. What is the adjoint of "send chunk j to rank j"? (Chapter 11's
        all_to_all_rows asks the same for uneven chunks.)
    """
    raise NotImplementedError("exercise: all-to-all heads for sequence, causal SDPA, all-to-all back, with autograd")
