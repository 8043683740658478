"""The memory model's transients and a stack's selective recomputation (`plan.rank_memory`): the loss's working set
measured against the formula, ZeRO-3's gathered units, and what each stack's selective policy keeps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from minidist.memory import LiveTensorBytes
from minidist.model import get_preset
from minidist.parallel import Layout
from minidist.plan.rank_memory import (
    BF16_MEGATRON,
    BF16_MIXED,
    estimate_memory,
    loss_transient_bytes,
    zero3_gathered_bytes,
)
from minidist.plan.stack import PRESETS, load_stack

STACKS = Path(__file__).resolve().parents[1] / "configs" / "stacks"


def test_the_eager_loss_holds_eight_bytes_per_logit_beyond_its_softmax():
    """F.cross_entropy over the fp32 copy of bf16 logits (this trainer's loss and torchtitan's): at its peak, in the
    softmax's backward, the saved softmax and 8 bytes per logit more."""
    cfg = dataclasses.replace(get_preset("tiny"), vocab_size=4096)
    n, d = 512, 64
    h = torch.randn(n, d, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(cfg.vocab_size, d, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, cfg.vocab_size, (n,))
    with LiveTensorBytes() as live:
        loss = F.cross_entropy(F.linear(h, w).float(), targets)
        loss.backward()
    saved_softmax = 4 * n * cfg.vocab_size
    assert live.peak - saved_softmax == pytest.approx(loss_transient_bytes(cfg, n, 1, fused_loss=False), rel=0.01)
    assert loss_transient_bytes(cfg, n, 2, fused_loss=True) == 2 * n * cfg.vocab_size / 2  # a vocabulary shard


def test_the_loss_transient_is_charged_on_the_heads_rank_only():
    cfg = get_preset("llama3-8b")
    lay = Layout.of(pp=2, microbatches=4)
    first, last = (estimate_memory(cfg, lay, 1024, 1, BF16_MIXED, s) for s in (0, 1))
    assert first.loss_transient == 0 and last.loss_transient == loss_transient_bytes(cfg, 1024, 1, False)
    megatron = estimate_memory(cfg, lay, 1024, 1, BF16_MEGATRON, 1)
    assert megatron.loss_transient == last.loss_transient / 4  # the fused kernel: 2 bytes a logit, not 8
    rebuilt = estimate_memory(cfg, Layout.of(pp=2, microbatches=4, recompute="full"), 1024, 1, BF16_MIXED, 1)
    assert rebuilt.total - rebuilt.activations - rebuilt.params - rebuilt.grads - rebuilt.optimizer == \
        max(rebuilt.recompute_transient, rebuilt.loss_transient)  # one after the other, not both at once


def test_zero3_charges_two_gathered_units_and_one_unsharded_gradient():
    cfg = get_preset("llama3-8b")
    for zero in (0, 1, 2):
        assert zero3_gathered_bytes(cfg, Layout.of(dp=8, zero=zero), BF16_MIXED, 0) == 0
    whole, split = (zero3_gathered_bytes(cfg, Layout.of(dp=8, tp=tp, zero=3), BF16_MIXED, 0) for tp in (1, 2))
    embedding = cfg.vocab_size * cfg.d_model  # Llama 3 8B's largest unit: 525M parameters against a block's 218M
    assert whole == embedding * (2 * 2 + 2) and split == whole / 2
    middle = zero3_gathered_bytes(cfg, Layout.of(dp=2, pp=4, zero=3, microbatches=4), BF16_MIXED, 1)
    assert 0 < middle < whole  # a middle stage gathers blocks, never the embedding
    assert estimate_memory(cfg, Layout.of(dp=8, zero=3), 1024, 1, BF16_MIXED).gathered == whole


def _stack(tmp_path, text: str):
    path = tmp_path / "s.toml"
    path.write_text(text)
    return load_stack(str(path))


def test_each_stacks_selective_recomputation_keeps_what_its_policy_saves(tmp_path):
    cfg, n = get_preset("llama3-8b"), 2048

    def acts(precision, recompute):
        return estimate_memory(cfg, Layout.of(dp=8, recompute=recompute), n, 1, precision).activations
    matmuls, alternate, core = (_stack(tmp_path, f'selective = "{k}"\n').precision
                                for k in ("matmuls", "alternate_matmuls", "core_attention"))
    assert PRESETS["trainer"].precision.selective == "matmuls"
    assert load_stack(str(STACKS / "torchtitan.toml")).precision.selective == "alternate_matmuls"
    assert PRESETS["megatron"].precision.selective == "core_attention"  # Korthikanti et al.'s selective
    assert acts(alternate, "selective") < acts(matmuls, "selective") < acts(matmuls, "none")
    assert acts(core, "selective") == acts(core, "none")  # under FlashAttention the core keeps what it needs anyway
    # the alternate policy drops k, the attention's projection and x·W3 of what the trainer's keeps
    per_token = 2 * (cfg.n_kv_heads * cfg.head_dim + cfg.d_model + cfg.d_ff)
    assert acts(matmuls, "selective") - acts(alternate, "selective") == cfg.n_layers * n * per_token


def test_torchtitans_selective_recomputation_pays_for_its_recomputed_matmuls(tmp_path):
    """Every second matmul of each block runs again in the backward: wk, wo and w3 of a Llama block."""
    from minidist.plan.cluster import cluster_for_chip
    from minidist.plan.step_time import predict_step
    cfg, lay = get_preset("llama3-8b"), Layout.of(dp=8, zero=3, recompute="selective")
    cluster = cluster_for_chip("H100-SXM")
    matmuls, alternate = (_stack(tmp_path, f'selective = "{k}"\n').precision for k in ("matmuls", "alternate_matmuls"))
    t_matmuls, t_alternate = (predict_step(cfg, lay, 8192, 16, cluster, p) for p in (matmuls, alternate))
    d, kv, ff = cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg.d_ff
    again = 2 * (d * kv + d * d + d * ff) * cfg.n_layers * 16 * 8192 / 8  # FLOPs per rank
    rate = cluster.peak_flops * cluster.efficiency  # the planner's one matmul rate
    assert t_alternate.compute - t_matmuls.compute == pytest.approx(again / rate, rel=1e-6)
