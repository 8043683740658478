"""The vocabulary split across tensor-parallel ranks: embedding rows and output logits (Megatron-LM §3).

With p ranks and a vocabulary of V tokens, rank r owns the tokens [r·V/p, (r+1)·V/p): the rows of the embedding
table and the rows of the output projection (the lm_head), i.e. a slice of the logits' last dimension.

Embedding. Each rank looks up the tokens it owns and writes zeros for the others; summing over the ranks gives
every token its row. The sum is the g operator (all-reduce forward, identity backward) or, with sequence
parallelism, a reduce-scatter along the sequence.

Cross-entropy without full-vocab logits anywhere. For one token with logits z (split across ranks) and target t:

    loss = log Σ_j exp(z_j) − z_t = log Σ_j exp(z_j − m) − (z_t − m),   m = max_j z_j

m is an all-reduce(max) of the local maxima; Σ exp(z_j − m) is an all-reduce(sum) of local sums; z_t − m lives on
exactly one rank (zeros elsewhere), so it is an all-reduce(sum) too (sent together with the sums: one call).
The gradient with respect to the local logits is local: softmax(z)_j − [j = t], divided by the number of counted
tokens for a mean. Targets equal to `ignore_index` contribute no loss and no gradient, as in F.cross_entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minidist.comm.communicator import Comm


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the tokens owned by tensor-parallel rank `rank` of `size` (size must divide vocab_size)."""
    if vocab_size % size:
        raise ValueError(f"tp={size} does not divide vocab_size={vocab_size}; pad the vocabulary to a multiple of "
                         f"{size} (e.g. {-(-vocab_size // size) * size})")
    per = vocab_size // size
    return rank * per, (rank + 1) * per


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows of a token embedding. The output is summed over ranks by `reduce_fn` (g or reduce-scatter).

    It stays an nn.Embedding (with num_embeddings = V/p), so code that treats embeddings specially (no weight
    decay) still recognizes it. `weight` is a slice of the full table: rows vocab_start..vocab_end.
    """

    def __init__(self, weight: torch.Tensor, vocab_start: int, reduce_fn) -> None:
        nn.Module.__init__(self)  # skip nn.Embedding's allocation; the weight is given
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx, self.max_norm, self.norm_type = None, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.vocab_start, self.vocab_end = vocab_start, vocab_start + self.num_embeddings
        self.reduce_fn = reduce_fn

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        foreign = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
        local = (tokens - self.vocab_start).masked_fill(foreign, 0)  # any valid row; zeroed just below
        partial = F.embedding(local, self.weight).masked_fill(foreign.unsqueeze(-1), 0.0)
        return self.reduce_fn(partial)

    def extra_repr(self) -> str:
        return f"rows {self.vocab_start}..{self.vocab_end}, dim {self.embedding_dim}"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token losses [N] from local logits [N, V/p]; the backward needs no communication."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, comm: Comm, ignore_index: int) -> torch.Tensor:
        z = logits.float()
        n_local = z.shape[-1]
        start = comm.rank * n_local

        m = z.max(dim=-1).values  # a fresh tensor: safe to reduce in place
        comm.all_reduce(m, op="max")
        shifted = z - m.unsqueeze(-1)

        valid = targets != ignore_index
        local_target = targets - start
        mine = valid & (local_target >= 0) & (local_target < n_local)
        index = local_target.clamp(0, n_local - 1)
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * mine

        exp = shifted.exp()
        stats = torch.stack([exp.sum(dim=-1), target_logit])  # [2, N]: one all-reduce carries both sums
        comm.all_reduce(stats)
        sum_exp, target_logit = stats[0], stats[1]

        losses = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine, valid)
        ctx.logits_dtype = logits.dtype
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        softmax, index, mine, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, index.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_losses * valid).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, comm: Comm, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of vocab-sharded logits [..., V/p] against full targets [...], in fp32; equal on every rank.

    Equals F.cross_entropy(full logits, targets, ignore_index=ignore_index, reduction=reduction) where the full
    logits are the concatenation of every rank's shard along the last dimension. "mean" divides by the number of
    targets that are not `ignore_index` (NaN when there are none, as in torch).
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: want logits "
                         f"[..., V/p] with targets [...]")
    vocab = logits.shape[-1] * comm.size
    valid = targets != ignore_index
    # Checked on the device (an error on the CPU, a device-side assert on a GPU), as F.cross_entropy does: a host
    # read of the check would stop the host every micro-batch.
    torch._assert_async(~(valid & ((targets < 0) | (targets >= vocab))).any(),
                        f"targets must lie in [0, {vocab}) or equal ignore_index={ignore_index}")
    losses = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), comm,
                                              ignore_index)
    if reduction == "none":
        return losses.view(targets.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / valid.sum()
