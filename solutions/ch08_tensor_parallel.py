"""Chapter 08 exercises, answered: Megatron's column- and row-parallel linears with their communication operators,
and the vocab-parallel cross-entropy on real ranks.

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model Parallelism", §3:
f (identity forward, all-reduce backward) where a replicated input enters a column-parallel layer, g (all-reduce
forward, identity backward) where a row-parallel layer's partial sums leave; plus the two operators Megatron uses
when a layer stands alone: gather (all-gather forward, keep my slice backward) after a column-parallel layer, and
scatter (keep my slice forward, all-gather backward) before a row-parallel one. Each pair is conjugate: what one
does forward, the other does backward.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, op=op, group=group)
    return x


def _gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def _my_slice_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    p, r = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(p, dim=-1)[r].contiguous()


class _CopyToRegion(torch.autograd.Function):  # f
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):  # g
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):  # all-gather forward, my slice backward
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _my_slice_last_dim(grad, ctx.group), None


class _ScatterToRegion(torch.autograd.Function):  # my slice forward, all-gather backward
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_slice_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group: dist.ProcessGroup | None = None, gather_output: bool = False) -> torch.Tensor:
    """This rank's output features of a linear layer, or all of them (see exercises/ch08_tensor_parallel.py)."""
    y = F.linear(_CopyToRegion.apply(x, group), weight, bias)
    return _GatherFromRegion.apply(y, group) if gather_output else y


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        group: dist.ProcessGroup | None = None, input_is_parallel: bool = True) -> torch.Tensor:
    """The full output of a linear layer from this rank's input features (see exercises/ch08_tensor_parallel.py)."""
    if not input_is_parallel:
        x = _ScatterToRegion.apply(x, group)
    y = _ReduceFromRegion.apply(F.linear(x, weight), group)
    return y if bias is None else y + bias  # once, after the sum: added on every rank before it, it would count p times


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group, ignore_index):
        width = logits.shape[-1]
        m = logits.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)  # only keeps exp() from overflowing
        exp = (logits - m.unsqueeze(-1)).exp()
        valid = targets != ignore_index
        local = targets - vocab_start
        mine = valid & (local >= 0) & (local < width)
        index = local.clamp(0, width - 1)
        target_logit = (logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - m) * mine
        stats = torch.stack([exp.sum(dim=-1), target_logit])  # both sums in one call
        dist.all_reduce(stats, group=group)
        losses = (stats[0].log() - stats[1]) * valid
        ctx.save_for_backward(exp / stats[0].unsqueeze(-1), index, mine, valid)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        softmax, index, mine, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, index.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))  # softmax − one-hot
        return grad * (grad_losses * valid).unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 group: dist.ProcessGroup | None = None, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy from this rank's vocabulary shard of the logits (see exercises/ch08)."""
    return _VocabParallelCrossEntropy.apply(logits, targets, vocab_start, group, ignore_index)
