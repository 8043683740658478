"""Tensor parallelism (Shoeybi et al. 2019, "Megatron-LM", §3) and sequence parallelism (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", §4.2), applied to a built plain model.

A linear layer Y = X Aᵀ splits two ways across p ranks:
- column-parallel: A by output rows, so rank r computes Y_r = X A_rᵀ, a slice of Y's features; X must be whole;
- row-parallel: A by input columns, so rank r computes X_r A_rᵀ, a partial sum; Y = Σ_r X_r A_rᵀ.
A column-parallel layer feeding a row-parallel one needs no communication in between (the slice of features is
exactly the slice of inputs the next layer wants), so an MLP, or attention split by heads, costs one reduction
forward and one backward. Megatron calls the two conjugate operators around such a region
    f: identity forward, all-reduce backward   (enters the region: each rank's input-gradient is a partial sum)
    g: all-reduce forward, identity backward   (leaves the region: sums the partial outputs)
With sequence parallelism, the activations outside the regions (norms, residual adds) are split along the
sequence instead of replicated, and f/g become all-gather / reduce-scatter along the sequence, in both directions:
the same bytes (all-reduce = reduce-scatter + all-gather), and p times less activation memory outside the regions.

`apply_tensor_parallel(model, cfg, tp_comm)` swaps modules by a plan (`tensor_parallel_plan`, plain data) and keeps
every parameter name, so init values, checkpoints and parity compare by name; each shard is a slice of the full
value the model was built with. The model then returns this rank's vocabulary shard of the logits; the loss is
`vocab_parallel_lm_loss`. Replicated parameters whose gradient is a partial sum over the tp ranks (norm weights
under sequence parallelism, key/value heads replicated because tp > n_kv_heads, MLA's latent down-projections)
get a gradient hook that sums it: f applied to the parameter itself.

MoE layers stay whole on every tp rank: each routes the same tokens through the same experts, so their gradients
are identical over tp, with no communication (expert parallelism, chapter 11, splits experts over dp ranks). Under
sequence parallelism the layer runs on the gathered sequence (capacity and balance loss are per sequence), keeps its
output slice, and all-gathers the output's gradient: every rank computes the same gradients again.

Every parameter records its slice of the full tensor (`param.placement`: a `layout.Placement` with a "tp" `Split`);
the gradient norm and full tensors read it. The vocabulary split is in `minidist.parallel.tp.vocab`.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from minidist.comm.communicator import Comm, ring_bytes_sent
from minidist.model.attention import GroupedQueryAttention
from minidist.model.config import ModelConfig
from minidist.model.layers import GeluMLP, SwiGLU
from minidist.model.mla import MultiHeadLatentAttention
from minidist.model.moe import MoELayer
from minidist.parallel.placement import Split, narrow, placement_of, set_split
from minidist.parallel.tp.vocab import VocabParallelEmbedding, vocab_parallel_lm_loss, vocab_range

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "apply_tensor_parallel", "copy_to_tp", "expected_tp_traffic",
    "gather_sequence", "reduce_from_tp", "reduce_scatter_sequence", "tensor_parallel_plan", "validate_tensor_parallel",
    "vocab_parallel_lm_loss",
]

# ---------------------------------------------------------------------------------------------------------------
# The conjugate operators. reduce_dtype (e.g. torch.float32) sums bf16 partial sums in a wider type: upcast,
# reduce, downcast; twice the bytes, but the error no longer grows with the number of ranks (notebook 08).
# ---------------------------------------------------------------------------------------------------------------


def _all_reduce(x: torch.Tensor, comm: Comm, reduce_dtype: torch.dtype | None) -> torch.Tensor:
    y = x.to(reduce_dtype or x.dtype, memory_format=torch.contiguous_format, copy=True)
    comm.all_reduce(y)
    return y.to(x.dtype)


# Comm gathers and scatters along dim 0; the sequence is dim 1 of [batch, seq, ...]. The results are made contiguous
# again: a transposed view would make each linear that reads it save its own contiguous copy for the backward pass.
def _gather_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return comm.all_gather(x.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, comm: Comm, reduce_dtype: torch.dtype | None) -> torch.Tensor:
    y = x.transpose(0, 1).to(reduce_dtype or x.dtype, memory_format=torch.contiguous_format)
    return comm.reduce_scatter(y).transpose(0, 1).to(x.dtype, memory_format=torch.contiguous_format)


class _CopyToTP(torch.autograd.Function):  # f
    @staticmethod
    def forward(ctx, x, comm, reduce_dtype):
        ctx.comm, ctx.reduce_dtype = comm, reduce_dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.comm, ctx.reduce_dtype), None, None


class _ReduceFromTP(torch.autograd.Function):  # g
    @staticmethod
    def forward(ctx, x, comm, reduce_dtype):
        return _all_reduce(x, comm, reduce_dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _GatherSequence(torch.autograd.Function):  # Korthikanti's g: all-gather forward, reduce-scatter backward
    @staticmethod
    def forward(ctx, x, comm, reduce_dtype):
        ctx.comm, ctx.reduce_dtype = comm, reduce_dtype
        return _gather_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.comm, ctx.reduce_dtype), None, None


class _ReduceScatterSequence(torch.autograd.Function):  # Korthikanti's ḡ: reduce-scatter forward, all-gather back
    @staticmethod
    def forward(ctx, x, comm, reduce_dtype):
        ctx.comm = comm
        return _reduce_scatter_seq(x, comm, reduce_dtype)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.comm), None, None


def _slice_seq(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return x.narrow(1, comm.rank * (x.shape[1] // comm.size), x.shape[1] // comm.size).contiguous()


class _GatherWholeSequence(torch.autograd.Function):  # all-gather; backward: my slice of a gradient all ranks hold
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _gather_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _slice_seq(grad, ctx.comm), None


class _SliceSequence(torch.autograd.Function):  # the converse: my slice of a tensor all ranks hold; all-gather back
    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        return _slice_seq(x, comm)

    @staticmethod
    def backward(ctx, grad):
        return _gather_seq(grad, ctx.comm), None


def copy_to_tp(x: torch.Tensor, comm: Comm, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """f: identity forward; all-reduce of the gradient over tp backward."""
    return _CopyToTP.apply(x, comm, reduce_dtype)


def reduce_from_tp(x: torch.Tensor, comm: Comm, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """g: all-reduce over tp forward (optionally in reduce_dtype); identity backward."""
    return _ReduceFromTP.apply(x, comm, reduce_dtype)


def gather_sequence(x: torch.Tensor, comm: Comm, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, T/p, ...] -> [B, T, ...]: all-gather along the sequence forward; reduce-scatter of the gradient back."""
    return _GatherSequence.apply(x, comm, reduce_dtype)


def reduce_scatter_sequence(x: torch.Tensor, comm: Comm, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """[B, T, ...] partial sums -> [B, T/p, ...] summed: reduce-scatter forward; all-gather of the gradient back."""
    return _ReduceScatterSequence.apply(x, comm, reduce_dtype)


def _shard(param: nn.Parameter | None, split: Split) -> nn.Parameter | None:
    """A new Parameter holding this rank's slice (a copy: the full tensor can be freed), with its placement."""
    if param is None:
        return None
    shard = nn.Parameter(narrow(param.detach(), split).clone(), requires_grad=param.requires_grad)
    set_split(shard, "tp", split, param.shape)
    return shard


def _sum_grad_over_tp(param: nn.Parameter, comm: Comm) -> None:
    """The gradient of a replicated parameter that each rank used on different data is the sum over the ranks."""
    param.register_hook(lambda grad: _all_reduce(grad, comm, None))


def _sum_grad_over_replicas(param: nn.Parameter, comm: Comm) -> None:
    """Sum the gradient over the tp ranks holding the same slice (replicated kv heads), with one all-reduce over
    the whole tp group: each rank writes its gradient into its slot of a full-size buffer, zeros elsewhere."""
    split = placement_of(param).splits["tp"]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        buffer = grad.new_zeros((split.parts, *grad.shape))
        buffer[split.index] = grad
        comm.all_reduce(buffer)
        return buffer[split.index]

    param.register_hook(hook)


# ---------------------------------------------------------------------------------------------------------------
# Sharded linears
# ---------------------------------------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Linear):
    """A slice of a linear's output features (weight and bias split by rows). No communication of its own: the
    input reaches it through the region's entry (f, or an all-gather along the sequence)."""

    def __init__(self, full: nn.Linear, split: Split) -> None:
        nn.Module.__init__(self)  # skip nn.Linear's allocation; the parameters are slices of `full`
        self.weight = _shard(full.weight, split)
        self.bias = _shard(full.bias, split)
        self.out_features, self.in_features = self.weight.shape


class RowParallelLinear(nn.Linear):
    """A slice of a linear's input features: partial sums, reduced by g (or a reduce-scatter along the sequence);
    the bias (replicated) is added once, after the reduction."""

    def __init__(self, full: nn.Linear, rank: int, size: int, comm: Comm, sequence_parallel: bool,
                 reduce_dtype: torch.dtype | None) -> None:
        nn.Module.__init__(self)
        self.weight = _shard(full.weight, Split(dim=1, index=rank, parts=size, replicas=1))
        self.bias = _shard(full.bias, Split(dim=None, index=0, parts=1, replicas=size))
        self.out_features, self.in_features = self.weight.shape
        self.comm, self.sequence_parallel, self.reduce_dtype = comm, sequence_parallel, reduce_dtype
        if self.bias is not None and sequence_parallel:
            _sum_grad_over_tp(self.bias, comm)  # added on a sequence shard only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial_sums = F.linear(x, self.weight)
        reduce = reduce_scatter_sequence if self.sequence_parallel else reduce_from_tp
        y = reduce(partial_sums, self.comm, self.reduce_dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)


# ---------------------------------------------------------------------------------------------------------------
# The plan: which module becomes what
# ---------------------------------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_tensor_parallel(cfg: ModelConfig, tp: int, seq_len: int | None = None,
                             sequence_parallel: bool = False) -> None:
    """One-line ValueError if `cfg` cannot be split over `tp` ranks. Needs no process group: call it early."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if tp == 1:
        return
    if cfg.n_heads % tp:
        raise ValueError(f"tp={tp} does not divide n_heads={cfg.n_heads} (attention is split by heads); pick tp "
                         f"from {_divisors(cfg.n_heads)}")
    kv = cfg.n_kv_heads
    if cfg.attention == "gqa" and kv % tp and tp % kv:
        fits = [d for d in _divisors(cfg.n_heads) if kv % d == 0 or d % kv == 0]
        raise ValueError(f"tp={tp} neither divides n_kv_heads={kv} (split the kv heads) nor is a multiple of it "
                         f"(replicate them); pick tp from {fits}")
    if cfg.d_ff % tp:
        raise ValueError(f"tp={tp} does not divide d_ff={cfg.d_ff} (the MLP is split by hidden units); pick tp "
                         f"from {_divisors(cfg.d_ff)}")
    if cfg.vocab_size % tp:
        raise ValueError(f"tp={tp} does not divide vocab_size={cfg.vocab_size} (the vocabulary is split across "
                         f"ranks); pad vocab_size to {-(-cfg.vocab_size // tp) * tp}")
    if sequence_parallel and seq_len is not None and seq_len % tp:
        raise ValueError(f"sequence parallel needs seq_len={seq_len} divisible by tp={tp}; pick a multiple of {tp}")


def tensor_parallel_plan(model: nn.Module, sequence_parallel: bool = False) -> dict[str, str]:
    """{module name: style} for a `minidist.model.Transformer`. Styles:

    vocab_embedding  rows of the embedding; output summed by g (or reduce-scattered along the sequence)
    region           the module's input enters the tp region: f (or an all-gather along the sequence)
    colwise          column-parallel linear;   colwise_kv: the same for key/value heads (split or replicated)
    rowwise          row-parallel linear, output reduced by g (or reduce-scattered)
    vocab_head       region + colwise: the lm_head, whose output is this rank's slice of the logits
    sequence_norm    (sequence parallel) a norm on a sequence shard: its gradient is summed over tp
    sequence_slice   (sequence parallel) the learned position embedding, cut to this rank's positions
    shared_in_region (MLA) replicated inside a region (the latent down-projections and their norms): each rank uses
                     it for its own heads only, so its gradient is summed over tp
    moe              an MoE layer, whole on every rank: no communication
    moe_sequence     (sequence parallel) an MoE layer on the gathered sequence, output sliced, its gradient gathered
    """
    plan = {"tok_emb": "vocab_embedding"}
    if sequence_parallel and getattr(model, "pos_emb", None) is not None:
        plan["pos_emb"] = "sequence_slice"
    for i, block in enumerate(model.blocks):
        b = f"blocks.{i}"
        if not isinstance(block.attn, (GroupedQueryAttention, MultiHeadLatentAttention)):
            raise ValueError(f"{b}.attn is {type(block.attn).__name__}; tensor parallelism supports "
                             "GroupedQueryAttention and MultiHeadLatentAttention")
        if not isinstance(block.mlp, (SwiGLU, GeluMLP, MoELayer)):
            raise ValueError(f"{b}.mlp is {type(block.mlp).__name__}; tensor parallelism supports SwiGLU, GELU "
                             "and MoE MLPs")
        if sequence_parallel:
            plan[f"{b}.attn_norm"] = "sequence_norm"
        if isinstance(block.attn, GroupedQueryAttention):
            plan |= {f"{b}.attn": "region", f"{b}.attn.wq": "colwise", f"{b}.attn.wk": "colwise_kv",
                     f"{b}.attn.wv": "colwise_kv", f"{b}.attn.wo": "rowwise"}
        else:  # MLA: per-head weights split by heads, the latent path replicated
            plan[f"{b}.attn"] = "region"
            if hasattr(block.attn, "wq"):
                plan[f"{b}.attn.wq"] = "colwise"
            else:
                plan |= {f"{b}.attn.wq_a": "shared_in_region", f"{b}.attn.q_norm": "shared_in_region",
                         f"{b}.attn.wq_b": "colwise"}
            plan |= {f"{b}.attn.wkv_a": "shared_in_region", f"{b}.attn.kv_norm": "shared_in_region",
                     f"{b}.attn.wkv_b": "colwise", f"{b}.attn.wo": "rowwise"}
        if sequence_parallel:
            plan[f"{b}.mlp_norm"] = "sequence_norm"
        if isinstance(block.mlp, MoELayer):  # whole on every tp rank (the module docstring says why)
            plan[f"{b}.mlp"] = "moe_sequence" if sequence_parallel else "moe"
            continue
        plan[f"{b}.mlp"] = "region"
        for name in ("w1", "w3"):
            if hasattr(block.mlp, name):
                plan[f"{b}.mlp.{name}"] = "colwise"
        plan[f"{b}.mlp.w2"] = "rowwise"
    if sequence_parallel:
        plan["norm"] = "sequence_norm"
    plan["lm_head"] = "vocab_head"
    return plan


def apply_tensor_parallel(model: nn.Module, cfg: ModelConfig, tp_comm: Comm, sequence_parallel: bool = False,
                          reduce_dtype: torch.dtype | None = None) -> nn.Module:
    """Shard a built `Transformer` in place over the ranks of `tp_comm` and return it.

    Afterwards `model(tokens)` returns this rank's vocabulary slice of the logits [B, T, V/tp] (score them with
    `vocab_parallel_lm_loss(logits, targets, tp_comm)`); with `sequence_parallel`, T must be divisible by tp. Every
    parameter keeps its name and carries `param.placement` (its "tp" split). Apply it after moving the model to its
    device (the gradient hooks live on the parameter objects). `reduce_dtype=torch.float32` sums bf16 partial sums
    in fp32.
    """
    tp, rank = tp_comm.size, tp_comm.rank
    validate_tensor_parallel(cfg, tp)
    if tp == 1:
        return model
    kv_split = (Split(0, rank, tp, 1) if cfg.n_kv_heads % tp == 0
                else Split(0, rank // (tp // cfg.n_kv_heads), cfg.n_kv_heads, tp // cfg.n_kv_heads))
    split = Split(0, rank, tp, 1)
    if sequence_parallel:
        enter, exit_ = gather_sequence, reduce_scatter_sequence
    else:
        enter, exit_ = copy_to_tp, reduce_from_tp
    tied = model.lm_head.weight is model.tok_emb.weight

    def enter_hook(module, args):
        return (enter(args[0], tp_comm, reduce_dtype), *args[1:])

    for name, style in tensor_parallel_plan(model, sequence_parallel).items():
        module = model.get_submodule(name)
        if style == "vocab_embedding":
            start, _ = vocab_range(cfg.vocab_size, rank, tp)
            new = VocabParallelEmbedding(_shard(module.weight, split), start,
                                         partial(exit_, comm=tp_comm, reduce_dtype=reduce_dtype))
            model.set_submodule(name, new)
        elif style in ("colwise", "colwise_kv"):
            new = ColumnParallelLinear(module, kv_split if style == "colwise_kv" else split)
            if kv_split.replicas > 1 and style == "colwise_kv":
                for param in new.parameters():
                    _sum_grad_over_replicas(param, tp_comm)
            model.set_submodule(name, new)
        elif style == "rowwise":
            model.set_submodule(name, RowParallelLinear(module, rank, tp, tp_comm, sequence_parallel, reduce_dtype))
        elif style == "vocab_head":
            new = ColumnParallelLinear(module, split)
            if tied:
                new.weight = model.tok_emb.weight  # the same vocabulary rows: the tie survives sharding
            new.register_forward_pre_hook(enter_hook)
            model.set_submodule(name, new)
        elif style == "region":
            module.register_forward_pre_hook(enter_hook)
        elif style in ("sequence_norm", "shared_in_region"):
            for param in module.parameters():
                _sum_grad_over_tp(param, tp_comm)
        elif style == "moe_sequence":
            module.register_forward_pre_hook(lambda m, args: (_GatherWholeSequence.apply(args[0], tp_comm),))
            module.register_forward_hook(lambda m, args, out: _SliceSequence.apply(out, tp_comm))
        elif style == "sequence_slice":
            _sum_grad_over_tp(module.weight, tp_comm)
            module.register_forward_hook(lambda m, args, out: out.narrow(-2, rank * (out.shape[-2] // tp),
                                                                         out.shape[-2] // tp))
    for param in model.parameters():
        if "tp" not in placement_of(param).splits:  # replicated: identical value and gradient on every tp rank
            set_split(param, "tp", Split(None, 0, 1, tp), param.shape)
    return model


# ---------------------------------------------------------------------------------------------------------------
# Communication of one forward + backward, from the formulas (notebook 08 derives them)
# ---------------------------------------------------------------------------------------------------------------


def expected_tp_traffic(cfg: ModelConfig, batch: int, seq_len: int, tp: int, sequence_parallel: bool = False,
                        compute_bytes: int = 4, reduce_bytes: int | None = None,
                        rank: int = 0) -> dict[tuple[str, str], dict[str, int]]:
    """{(op, "tp"): {"calls", "bytes"}} one tp rank records for one forward + backward + vocab-parallel loss.

    Per block, the two regions (attention, MLP) each cost one entry and one exit, in both directions; the
    embedding's exit, the lm_head's entry and the loss's two small all-reduces come once. Element sizes: the
    row-parallel partial sums are in the compute dtype (`compute_bytes`: 2 under bf16 autocast) and are summed in
    `reduce_bytes` (default: the same; 4 with reduce_dtype=float32); everything else (the residual stream that
    enters a region and its gradient, the embedding, the loss statistics, parameter gradients) is fp32, because
    parameters are fp32 and autocast lowers only the matmuls.
    """
    counts: dict[tuple[str, str], dict[str, int]] = {}

    def add(op: str, shape: tuple[int, ...], element_size: int, calls: int = 1) -> None:
        entry = counts.setdefault((op, "tp"), {"calls": 0, "bytes": 0})
        entry["calls"] += calls
        entry["bytes"] += calls * ring_bytes_sent(op, shape, element_size, tp, rank)

    reduce_bytes = reduce_bytes or compute_bytes
    act = (seq_len, batch, cfg.d_model)
    n_tokens = batch * seq_len
    L = cfg.n_layers
    moe = L - cfg.moe.first_dense_layers if cfg.moe.n_experts else 0  # MoE blocks: whole, no MLP region
    exits, entries = 2 * L - moe, 2 * L + 1 - moe  # entries: attention, dense MLP, and the lm_head
    if sequence_parallel:
        add("reduce_scatter", act, reduce_bytes, exits)  # exit, forward
        add("all_gather", act, compute_bytes, exits)  # exit, backward
        add("all_gather", act, 4, entries)  # entry, forward
        add("reduce_scatter", act, 4, entries)  # entry, backward
        add("reduce_scatter", act, 4)  # embedding, forward
        add("all_gather", act, 4)  # embedding, backward
        add("all_gather", act, 4, 2 * moe)  # an MoE layer's input forward, its output's gradient backward
    else:
        add("all_reduce", act, reduce_bytes, exits)  # g, forward
        add("all_reduce", act, 4, entries)  # f, backward
        add("all_reduce", act, 4)  # embedding's g, forward
    add("all_reduce", (n_tokens,), 4)  # loss: max of the logits
    add("all_reduce", (2, n_tokens), 4)  # loss: sum of exponentials and the target logit, together
    if cfg.attention == "gqa" and cfg.n_kv_heads % tp and tp > 1:  # replicated kv heads: wk, wv (biases) summed
        kv_rows = cfg.n_kv_heads * cfg.head_dim
        add("all_reduce", (kv_rows, cfg.d_model), 4, 2 * L)
        if cfg.bias:
            add("all_reduce", (kv_rows,), 4, 2 * L)
    if cfg.attention == "mla" and tp > 1:  # the latent path's weights, used by this rank's heads only
        m = cfg.mla
        add("all_reduce", (m.kv_lora_rank + m.qk_rope_head_dim, cfg.d_model), 4, L)  # wkv_a
        add("all_reduce", (m.kv_lora_rank,), 4, L)  # kv_norm
        if m.q_lora_rank is not None:
            add("all_reduce", (m.q_lora_rank, cfg.d_model), 4, L)  # wq_a
            add("all_reduce", (m.q_lora_rank,), 4, L)  # q_norm
    if sequence_parallel:  # norm gains (and biases), row-parallel biases, positions: seen on a sequence shard
        norm_params = 2 if (cfg.norm == "layernorm" and cfg.bias) else 1
        add("all_reduce", (cfg.d_model,), 4, (2 * L + 1) * norm_params)
        if cfg.bias:
            add("all_reduce", (cfg.d_model,), 4, 2 * L - moe)
        if cfg.position == "learned":
            add("all_reduce", (cfg.max_seq_len, cfg.d_model), 4)
    return dict(sorted(counts.items()))
