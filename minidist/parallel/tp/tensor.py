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
The operators are in `minidist.parallel.tp.operators` (f, g) and `minidist.parallel.tp.sequence`, the sharded linears
in `minidist.parallel.tp.linear`, the expected traffic in `minidist.parallel.tp.traffic`.

`apply_tensor_parallel(model, cfg, tp_comm)` swaps modules by a plan (`tensor_parallel_plan`, plain data) and keeps
every parameter name, so init values, checkpoints and parity compare by name; each shard is a slice of the full
value the model was built with. The model then returns this rank's vocabulary shard of the logits; the loss is
`vocab_parallel_cross_entropy`. Replicated parameters whose gradient is a partial sum over the tp ranks (norm weights
under sequence parallelism, key/value heads replicated because tp > n_kv_heads, MLA's latent down-projections)
get a gradient hook that sums it: f applied to the parameter itself.

MoE layers stay whole on every tp rank: each routes the same tokens through the same experts, so their gradients
are identical over tp, with no communication (expert parallelism, chapter 11, splits experts over dp ranks). Under
sequence parallelism the layer runs on the gathered sequence (capacity and balance loss are per sequence), keeps its
output slice, and all-gathers the output's gradient: every rank computes the same gradients again.

Every parameter records its slice of the full tensor (`param.placement`: a `placement.Placement` with a "tp" `Split`);
the gradient norm and full tensors read it. The vocabulary split is in `minidist.parallel.tp.vocab`. This module
holds the plan and applies it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from minidist.comm.communicator import Comm
from minidist.model.attention import GroupedQueryAttention
from minidist.model.config import ModelConfig
from minidist.model.layers import GeluMLP, SwiGLU
from minidist.model.mla import MultiHeadLatentAttention
from minidist.model.moe.layer import MoELayer
from minidist.parallel.placement import Split, placement_of, set_split
from minidist.parallel.tp.linear import ColumnParallelLinear, RowParallelLinear, shard_parameter
from minidist.parallel.tp.operators import copy_to_tp, reduce_from_tp, sum_grad_over_replicas, sum_grad_over_tp
from minidist.parallel.tp.sequence import (
    gather_sequence,
    gather_whole_sequence,
    reduce_scatter_sequence,
    slice_sequence,
)
from minidist.parallel.tp.vocab import VocabParallelEmbedding, vocab_range

__all__ = ["apply_tensor_parallel", "tensor_parallel_plan", "validate_tensor_parallel"]


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


def validate_fp8_blocks(cfg: ModelConfig, tp: int, recipe: str, block: int) -> None:
    """Blockwise FP8 under tp: every shard of a split dimension (heads·head_dim, kv heads·head_dim, d_ff) must be
    whole blocks, so no 1×B tile or B×B block spans two ranks and each rank's scales are the unsharded layer's."""
    if recipe != "blockwise" or tp == 1:
        return
    if cfg.attention == "mla":
        raise ValueError("--fp8 blockwise with --tp > 1 is checked for MHA/GQA/MQA blocks only; use --fp8 rowwise "
                         "or --tp 1 with MLA")
    kv = cfg.n_kv_heads * cfg.head_dim // tp if cfg.n_kv_heads % tp == 0 else cfg.head_dim
    shards = {"n_heads*head_dim/tp": cfg.n_heads * cfg.head_dim // tp, "kv shard": kv, "d_ff/tp": cfg.d_ff // tp}
    bad = {name: size for name, size in shards.items() if size % block}
    if bad:
        fits = [b for b in (16, 32, 64, 128) if all(size % b == 0 for size in shards.values())]
        raise ValueError(f"--fp8 blockwise with tp={tp}: shards {bad} are not multiples of the block {block}; pick "
                         f"--fp8-block from {fits or 'a common divisor'}")


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
    `vocab_parallel_cross_entropy(logits, targets, tp_comm)`); with `sequence_parallel`, T must be divisible by tp.
    Every parameter keeps its name and carries `param.placement` (its "tp" split). Apply it after moving the model
    to its device (the gradient hooks live on the parameter objects). `reduce_dtype=torch.float32` sums bf16
    partial sums in fp32.
    """
    tp = tp_comm.size
    validate_tensor_parallel(cfg, tp)
    if tp == 1:
        return model
    sharding = _Sharding.of(model, cfg, tp_comm, sequence_parallel, reduce_dtype)
    for name, style in tensor_parallel_plan(model, sequence_parallel).items():
        _STYLES[style](sharding, model, name)
    for param in model.parameters():
        if "tp" not in placement_of(param).splits:  # replicated: identical value and gradient on every tp rank
            set_split(param, "tp", Split(None, 0, 1, tp), param.shape)
    return model


@dataclass
class _Sharding:
    """What every style of the plan needs to shard its module on this rank."""

    comm: Comm
    rank: int
    tp: int
    sequence_parallel: bool
    reduce_dtype: torch.dtype | None
    split: Split  # a slice by rows, one per rank
    kv_split: Split  # key/value heads: split, or replicated over tp // n_kv_heads ranks
    exit: Callable[..., torch.Tensor]  # g, or a reduce-scatter along the sequence
    enter_hook: Callable  # a forward pre-hook: the module's input enters the region (f, or an all-gather)
    vocab_size: int
    tied: bool  # the lm_head's weight is the embedding's

    @classmethod
    def of(cls, model: nn.Module, cfg: ModelConfig, comm: Comm, sequence_parallel: bool,
           reduce_dtype: torch.dtype | None) -> _Sharding:
        tp, rank = comm.size, comm.rank
        kv_split = (Split(0, rank, tp, 1) if cfg.n_kv_heads % tp == 0
                    else Split(0, rank // (tp // cfg.n_kv_heads), cfg.n_kv_heads, tp // cfg.n_kv_heads))
        enter, exit_ = (gather_sequence, reduce_scatter_sequence) if sequence_parallel else (copy_to_tp, reduce_from_tp)

        def enter_hook(module, args):
            return (enter(args[0], comm, reduce_dtype), *args[1:])

        return cls(comm, rank, tp, sequence_parallel, reduce_dtype, Split(0, rank, tp, 1), kv_split, exit_,
                   enter_hook, cfg.vocab_size, model.lm_head.weight is model.tok_emb.weight)


# -- one function per style of `tensor_parallel_plan` ------------------------------------------------------------


def _vocab_embedding(s: _Sharding, model: nn.Module, name: str) -> None:
    start, _ = vocab_range(s.vocab_size, s.rank, s.tp)
    module = model.get_submodule(name)
    model.set_submodule(name, VocabParallelEmbedding(shard_parameter(module.weight, s.split), start,
                                                     partial(s.exit, comm=s.comm, reduce_dtype=s.reduce_dtype)))


def _colwise(s: _Sharding, model: nn.Module, name: str) -> None:
    model.set_submodule(name, ColumnParallelLinear(model.get_submodule(name), s.split, s.comm))


def _colwise_kv(s: _Sharding, model: nn.Module, name: str) -> None:
    new = ColumnParallelLinear(model.get_submodule(name), s.kv_split, s.comm)
    if s.kv_split.replicas > 1:
        for param in new.parameters():
            sum_grad_over_replicas(param, s.comm)
    model.set_submodule(name, new)


def _rowwise(s: _Sharding, model: nn.Module, name: str) -> None:
    model.set_submodule(name, RowParallelLinear(model.get_submodule(name), s.rank, s.tp, s.comm,
                                                s.sequence_parallel, s.reduce_dtype))


def _vocab_head(s: _Sharding, model: nn.Module, name: str) -> None:
    new = ColumnParallelLinear(model.get_submodule(name), s.split)
    if s.tied:
        new.weight = model.tok_emb.weight  # the same vocabulary rows: the tie survives sharding
    new.register_forward_pre_hook(s.enter_hook)
    model.set_submodule(name, new)


def _region(s: _Sharding, model: nn.Module, name: str) -> None:
    model.get_submodule(name).register_forward_pre_hook(s.enter_hook)


def _summed_grads(s: _Sharding, model: nn.Module, name: str) -> None:  # sequence_norm, shared_in_region
    for param in model.get_submodule(name).parameters():
        sum_grad_over_tp(param, s.comm)


def _moe(s: _Sharding, model: nn.Module, name: str) -> None:
    """Whole on every tp rank, no communication (the module docstring says why)."""


def _moe_sequence(s: _Sharding, model: nn.Module, name: str) -> None:
    module, comm = model.get_submodule(name), s.comm
    module.register_forward_pre_hook(lambda m, args: (gather_whole_sequence(args[0], comm),))
    module.register_forward_hook(lambda m, args, out: slice_sequence(out, comm))


def _sequence_slice(s: _Sharding, model: nn.Module, name: str) -> None:
    module, rank, tp = model.get_submodule(name), s.rank, s.tp
    sum_grad_over_tp(module.weight, s.comm)
    module.register_forward_hook(lambda m, args, out: out.narrow(-2, rank * (out.shape[-2] // tp), out.shape[-2] // tp))


_STYLES: dict[str, Callable[[_Sharding, nn.Module, str], None]] = {
    "vocab_embedding": _vocab_embedding, "colwise": _colwise, "colwise_kv": _colwise_kv, "rowwise": _rowwise,
    "vocab_head": _vocab_head, "region": _region, "sequence_norm": _summed_grads, "shared_in_region": _summed_grads,
    "moe": _moe, "moe_sequence": _moe_sequence, "sequence_slice": _sequence_slice,
}
