"""A language-model loss that never holds the whole [tokens × vocab] fp32 logits: the head and the cross-entropy
run over chunks of tokens, and the backward recomputes each chunk's logits.

The plain loss (`lm_loss` over `lm_head`'s output) keeps, per micro-batch of N tokens and a vocabulary of V, the
logits, their fp32 copy and the log-softmax autograd saves: about 3 · N · V · 4 bytes (and as much again for their
gradients in the backward). For Llama 3's V = 128,256 and 8 × 2,048 tokens that is 25 GB, more than the weights of
an 8B model in bf16. Here the forward keeps only the hidden states and one log-sum-exp per token, and a chunk of C
tokens needs C · V · 4 bytes at a time (twice in the backward: the recomputed logits, turned in place into
softmax − one-hot, and their product with the weight). The price is one more head matmul per step (the forward's,
recomputed), the same trade as activation recomputation (Chen et al. 2016).

The gradient of Σ_i [logsumexp(z_i) − z_i[t_i]] with respect to the logits z_i is softmax(z_i) − onehot(t_i), so
with z = h Wᵀ: ∂/∂h = (softmax − onehot) W and ∂/∂W = (softmax − onehot)ᵀ h, summed chunk by chunk.

The matmul runs in fp32 (TF32 on CUDA when enabled) with autocast off: under bf16 autocast the plain head computes
bf16 logits, so the two agree to bf16 rounding there, and to fp32 rounding in fp32.
"""

from __future__ import annotations

import torch
from torch import nn


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                ignore_index: int) -> torch.Tensor:
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.float()  # no copy for fp32 weights
            for start in range(0, hidden.shape[0], chunk):
                logits = hidden[start:start + chunk].float() @ w.T  # [C, V]: the only vocabulary-sized tensor
                lse[start:start + chunk] = torch.logsumexp(logits, dim=-1)
                t = targets[start:start + chunk]
                picked = logits.gather(1, t.clamp(min=0)[:, None]).squeeze(1)
                total += ((lse[start:start + chunk] - picked) * (t != ignore_index)).sum()
                del logits
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.ignore_index = chunk, ignore_index
        return total

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.float()
            for start in range(0, hidden.shape[0], ctx.chunk):
                h = hidden[start:start + ctx.chunk].float()
                t = targets[start:start + ctx.chunk]
                valid = t != ctx.ignore_index
                # softmax − onehot, built in place in the recomputed logits, scaled by dL/dtotal (0 where ignored)
                grad = (h @ w.T).sub_(lse[start:start + ctx.chunk, None]).exp_()
                grad[torch.arange(t.shape[0], device=t.device), t.clamp(min=0)] -= 1.0
                grad.mul_((valid * grad_total.float())[:, None])
                if grad_hidden is not None:
                    grad_hidden[start:start + ctx.chunk] = (grad @ w).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight.addmm_(grad.T, h)
                del grad
        return grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None, None, None, None


def chunked_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int,
                    ignore_index: int = -100, reduction: str = "sum") -> torch.Tensor:
    """Next-token cross-entropy of the logits hidden @ weightᵀ (hidden [..., d], weight [V, d], targets [...]),
    `chunk` tokens at a time: the same value and gradients as `lm_loss(F.linear(hidden, weight), targets)` within
    fp32 rounding. reduction "sum" (Σ token losses) or "mean" (over the non-ignored targets)."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    total = _ChunkedLinearCrossEntropy.apply(hidden.flatten(0, -2), weight, targets.flatten(), chunk, ignore_index)
    return total if reduction == "sum" else total / (targets != ignore_index).sum()


class DeferredHead(nn.Module):
    """The place of `lm_head` when the loss is chunked: it holds the head's weight (same Parameter, same name
    "lm_head.weight", a tie to the embedding kept) and returns the final hidden states; `ChunkedLMLoss` applies it."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class ChunkedLMLoss:
    """loss_fn(hidden, targets) -> Σ token losses (fp32) over the head of a model whose `lm_head` is a
    `DeferredHead`: what `minidist.parallel.assembly` scores a micro-batch with."""

    def __init__(self, head: DeferredHead, chunk: int) -> None:
        self.head, self.chunk = head, chunk

    def __call__(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return chunked_lm_loss(hidden, self.head.weight, targets, self.chunk, reduction="sum")


def apply_chunked_loss(model: nn.Module, chunk: int) -> ChunkedLMLoss:
    """Swap `model.lm_head` (a bias-free Linear) for a `DeferredHead` (in place) and return the loss that applies
    it `chunk` tokens at a time. The model then returns final hidden states instead of logits."""
    head = DeferredHead(model.lm_head.weight)
    model.lm_head = head
    return ChunkedLMLoss(head, chunk)
