"""Chapter 08 exercises: column- and row-parallel linears with their communication operators, and the
vocab-parallel cross-entropy, on real ranks.

Grade your answers with `make grade CH=08`. Each function runs on 2 and 3 ranks (float64 tensors); the grader
compares with the unsplit computation in one process: `torch.nn.functional.linear` with the full weight (output,
input gradient, and each rank's slice of the weight and bias gradients), a column-then-row MLP (which must cost
exactly one all-reduce forward and one backward), and `F.cross_entropy` (losses and logit gradients, with ignored
targets, uneven vocabulary shards, and logits so large that exp() overflows unless you subtract the max first).

The notebook (§2) wrote f and g inside one MLP. Here each linear stands alone, so it also needs the two operators
Megatron-LM uses when a split layer meets unsplit code (Shoeybi et al. 2019, §3; their code calls them
gather_from_tensor_model_parallel_region and scatter_to_tensor_model_parallel_region):

    operator   forward                             backward
    f          identity                            all-reduce (sum) of the gradient
    g          all-reduce (sum)                    identity
    gather     all-gather along the last dim       keep my slice of the gradient's last dim
    scatter    keep my slice of the last dim       all-gather the gradient along the last dim

Each is a `torch.autograd.Function` with a `forward(ctx, x, group)` and a `backward(ctx, grad)` that returns one
value per forward argument (`None` for `group`); keep `group` on ctx. Slices: rank r of p holds the r-th of p equal
slices, `t.chunk(p, dim=-1)[r]`. Tools: `dist.all_reduce(t, op=..., group=group)` (in place: reduce a copy, never
the tensor autograd gave you), `dist.all_gather(list_of_p_empty_tensors, t.contiguous(), group=group)`,
`dist.get_rank(group)`, `dist.get_world_size(group)`.
"""

import torch
import torch.distributed as dist


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group: dist.ProcessGroup | None = None, gather_output: bool = False) -> torch.Tensor:
    """y = x Wᵀ + b with W's output features (rows, in nn.Linear's [out, in] layout) split across the ranks.

    `x` [..., in] is the same on every rank (replicated); `weight` is this rank's rows [out/p, in] of the full
    weight and `bias` its slice [out/p] (or None). Return this rank's output features [..., out/p], or with
    `gather_output=True` all of them [..., out], equal to F.linear(x, full W, full b) on every rank.

    Gradients (what the grader checks after a backward): `weight.grad`, `bias.grad` are this rank's rows of the full
    layer's gradients, and `x.grad` is the *full* input gradient on every rank. Each rank's matmul sees only its
    own output features, so its x-gradient is a partial sum over them: f around x sums the partial sums. Under
    gather_output, the gradient reaching the gathered output is the same on every rank, and each rank passes back
    the slice that belongs to its features.

    Check on paper for p = 2: which of f / gather communicates in the forward pass, and which in the backward?
    """
    raise NotImplementedError("exercise: f, then this rank's F.linear, then (optionally) gather")


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        group: dist.ProcessGroup | None = None, input_is_parallel: bool = True) -> torch.Tensor:
    """y = x Wᵀ + b with W's input features (columns, in nn.Linear's [out, in] layout) split across the ranks.

    `weight` is this rank's columns [out, in/p] of the full weight; `bias` [out] (or None) is replicated. With
    `input_is_parallel=True`, `x` is this rank's slice of the input features [..., in/p] (a column-parallel layer's
    output); with False, `x` is the full input [..., in] on every rank and the rank keeps its own slice (scatter).
    Return the full output [..., out] on every rank, equal to F.linear(full x, full W, b).

    Each rank's matmul gives a full-size partial sum x_r W_rᵀ; g adds them. Add the bias *after* the sum: added
    by every rank before it, it would be counted p times. Gradients: `weight.grad` is this rank's columns of the full
    gradient, `bias.grad` the full bias gradient, and `x.grad` this rank's slice of the input gradient (parallel
    input) or the full input gradient (replicated input: the scatter's backward gathers the slices).

    Composed, column_parallel_linear(x, A_r, a_r) -> GeLU -> row_parallel_linear(., B_r, b) is the notebook's
    Megatron MLP: the grader counts exactly one all-reduce forward (g) and one backward (f).
    """
    raise NotImplementedError("exercise: (optionally) scatter, this rank's F.linear, g, then the bias")


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab_start: int,
                                 group: dist.ProcessGroup | None = None, ignore_index: int = -100) -> torch.Tensor:
    """Per-token cross-entropy [N] from this rank's shard [N, V_r] of the logits, equal on every rank.

    Rank r holds the logits of tokens [vocab_start, vocab_start + V_r) of a vocabulary of V = Σ V_r tokens (shards
    may differ in width when p does not divide V). `targets` [N] holds full-vocabulary ids, or `ignore_index`.
    Return F.cross_entropy(full logits, targets, ignore_index=ignore_index, reduction="none"): 0 at ignored tokens.

    The notebook's §4 did this on p shards in one process. Here the shards live on different ranks:
        m      = all-reduce(MAX) of each row's local max            (keeps exp from overflowing; logits of 1000
                                                                     overflow exp even in float64)
        S      = all-reduce(SUM) of Σ_local exp(z − m)
        z_t−m  = all-reduce(SUM) of (z_t − m) on the rank that owns t, 0 elsewhere (send it with S: one call)
        loss   = log S − (z_t − m)
    Write it as a torch.autograd.Function: the gradient of loss_i with respect to the local logits is
    softmax(z_i)_j − [j = t_i] for the rank's own j (softmax = exp(z − m) / S, already local), multiplied by the
    incoming gradient of loss_i (the grader back-propagates a weighted sum, not a mean). No communication in
    backward, and the forward all-reduces at most 3 numbers per token: the grader forbids every other collective.
    Ignored tokens get loss 0 and gradient 0; their target id (−100) must not be used as an index.
    """
    raise NotImplementedError("exercise: max, sum of exponentials and target logit by all-reduce; local backward")
