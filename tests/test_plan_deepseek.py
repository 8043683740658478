"""The planner's model of DeepSeek-V3's own stack: what its kernels save and recompute (minidist.plan.deepseek_saves,
§3.2.3 and §3.3.2 of its report) and multi-token prediction (minidist.plan.mtp, §2.2)."""

from __future__ import annotations

import dataclasses

import pytest

from minidist.flops import count_params, mfu_flops_per_token
from minidist.model import Transformer, get_preset
from minidist.parallel import Layout
from minidist.plan import deepseek_saves, mtp
from minidist.plan.cli import main
from minidist.plan.cluster import cluster_for_chip, fp8_rate
from minidist.plan.rank_memory import BF16_DEEPSEEK, BF16_MEGATRON, estimate_memory, rank_params
from minidist.plan.search import search
from minidist.plan.stages import head_stage
from minidist.plan.step_time import Recipe, predict_step, token_flops

MLA_MOE = dict(attention="mla", mla=dict(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                         v_head_dim=8),
               moe=dict(n_experts=4, top_k=2, n_shared_experts=1, d_expert=32, first_dense_layers=1))
FP8 = deepseek_saves.FP8_BYTES


def _weights(model: Transformer, block: int) -> dict[str, tuple[int, ...]]:
    prefix = f"blocks.{block}."
    return {n[len(prefix):]: tuple(p.shape) for n, p in model.named_parameters() if n.startswith(prefix)}


def test_saved_bytes_are_the_widths_of_the_built_blocks_tensors():
    """Every width the table keeps is read off a built model's weights (not the config's fields): the residual
    inputs (d), q's latent (wq_a's outputs), kv's latent with the rotary key (wkv_a's), the attention output (wo's
    inputs, E5M6), the lse per head, SwiGLU's input (w1's and w3's outputs, FP8) in a dense block; in an MoE block
    the router's scores, each routed row (d, FP8) and its SwiGLU input, the shared expert's."""
    cfg = get_preset("tiny", **MLA_MOE)
    model = Transformer(cfg)
    lay, n, r = Layout(), 64, 2
    dense, moe = _weights(model, 0), _weights(model, 1)
    d = dense["attn_norm.weight"][0]
    attention = (2 * n * (dense["attn.wq_a.weight"][0] + dense["attn.wkv_a.weight"][0])
                 + deepseek_saves.E5M6_BYTES * n * dense["attn.wo.weight"][1] + 4 * n * cfg.n_heads)
    inputs = 2 * r * n * d
    swiglu = FP8 * n * (dense["mlp.w1.weight"][0] + dense["mlp.w3.weight"][0])
    assert deepseek_saves.layer_bytes(cfg, 0, n, lay, r) == pytest.approx(inputs + attention + swiglu)
    experts, k, d_expert = moe["mlp.experts.w1"][0], cfg.moe.top_k, moe["mlp.experts.w1"][2]
    router = 4 * n * moe["mlp.router.weight"][0] + n * k * (8 + 4 + 16)
    routed = FP8 * n * k * (d + 2 * d_expert)
    shared = FP8 * n * (moe["mlp.shared.w1.weight"][0] + moe["mlp.shared.w3.weight"][0])
    assert experts == cfg.moe.n_experts
    assert deepseek_saves.layer_bytes(cfg, 1, n, lay, r) == pytest.approx(inputs + attention + router + routed + shared)


def test_recomputed_flops_are_the_up_projections_weights_once_forward():
    """The backward runs MLA's up-projections again: 2 FLOPs per weight of wq_b and wkv_b per token and block, the
    weights counted on the built model; a model without MLA recomputes no GEMM."""
    cfg = get_preset("tiny", **MLA_MOE)
    up = sum(p.numel() for name, p in Transformer(cfg).named_parameters() if name.endswith(("wq_b.weight",
                                                                                           "wkv_b.weight")))
    assert deepseek_saves.recomputed_flops_per_token(cfg) == 2 * up
    assert deepseek_saves.recomputed_flops_per_token(get_preset("tiny")) == 0


def test_deepseek_v3s_kernels_keep_a_fifth_of_megatrons_without_recomputation_and_the_same_under_full():
    """DeepSeek-V3's MoE block at 4,096 tokens keeps under a quarter of what Megatron-LM's kernels keep (FP8 copies,
    no q, k, v, no expert outputs); under full recomputation both keep each block's input alone."""
    v3 = get_preset("deepseek-v3")
    lay = Layout.of(pp=16, ep=64, dp=128, schedule="dualpipev", microbatches=120)
    ours = deepseek_saves.layer_bytes(v3, 3, 4096, lay, 2)
    from minidist.plan.rank_memory import layer_activation_bytes
    theirs = layer_activation_bytes(v3, 3, 4096, lay, 2, fused=True, sp_regather=True)
    assert ours < theirs / 4
    full = dataclasses.replace(lay, recompute="full")
    a, b = (estimate_memory(v3, full, 4096, 1, p, stage=5) for p in (BF16_DEEPSEEK, BF16_MEGATRON))
    assert a.activations == b.activations and a.recompute_transient < b.recompute_transient


def test_the_recomputed_up_projections_are_charged_at_the_fp8_rate():
    """Without recomputation, DeepSeek-V3's kernels add exactly the up-projections' FLOPs of the rank's tokens at the
    FP8 recipe's rate to the compute (element-wise passes off: no bandwidth on record)."""
    cfg = get_preset("tiny", **MLA_MOE)
    h800 = dataclasses.replace(cluster_for_chip("H800", efficiency=None), hbm_bandwidth=0.0)
    lay = Layout.of(dp=2, microbatches=4)
    recipe = Recipe(fp8="blockwise")
    with_saves = predict_step(cfg, lay, 256, 16, h800, BF16_DEEPSEEK, recipe=recipe)
    without = predict_step(cfg, lay, 256, 16, h800, dataclasses.replace(BF16_DEEPSEEK, fp8_saved=False), recipe=recipe)
    tokens = 16 * 256 / 2
    extra = deepseek_saves.recomputed_flops_per_token(cfg) * tokens / fp8_rate(h800, "blockwise")
    assert with_saves.compute - without.compute == pytest.approx(extra, rel=1e-9) and extra > 0
    lit = dataclasses.replace(h800, hbm_bandwidth=3.35e12)  # with element-wise passes: the norms, RoPE, SwiGLU again
    a, b = (predict_step(cfg, lay, 256, 16, lit, p, recipe=recipe)
            for p in (BF16_DEEPSEEK, dataclasses.replace(BF16_DEEPSEEK, fp8_saved=False)))
    assert b.elementwise < a.elementwise < 2 * b.elementwise


def test_deepseek_kernels_need_an_fp8_recipe_and_bring_their_own_selective_recomputation(capsys):
    """Planned without FP8 the kernels' FP8 copies mean nothing: refused in one line (also on the command line);
    with them, the search lists no `selective` layout (the kernels are their own) and --explain refuses one."""
    cfg = get_preset("tiny", **MLA_MOE)
    h800 = cluster_for_chip("H800", efficiency=None)
    with pytest.raises(ValueError, match="--fp8 blockwise"):
        search(cfg, 8, 256, 64 * 256, h800, BF16_DEEPSEEK)
    plan = search(cfg, 8, 256, 64 * 256, h800, BF16_DEEPSEEK, Recipe(fp8="blockwise"))
    assert plan.feasible and {c.layout.recompute for c in plan.feasible + plan.rejected} == {"none", "full"}
    assert main(["--model", "tiny", "--gpus", "8", "--gpu", "H800", "--kernels", "deepseek"]) == 2
    assert main(["--model", "tiny", "--gpus", "8", "--gpu", "H800", "--kernels", "deepseek", "--fp8", "blockwise",
                 "--explain", "dp=8 recompute=selective"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "--fp8 blockwise" in err[0] and "recompute=none or recompute=full" in err[1]


def test_multi_token_prediction_adds_a_block_a_projection_and_a_head_pass():
    """D = 1 on DeepSeek-V3: one more MoE block's FLOPs (the model's count with one more layer), the projection
    2d -> d and the head's 6·d·V per token again; its weights with the checkpoint's own copies of the embedding and
    the head come to 685B - 671B of the model card, both rounded to the billion (13 to 15 B)."""
    v3 = get_preset("deepseek-v3")
    longer = mtp.with_mtp(v3, 1)
    assert longer.n_layers == v3.n_layers + 1 and mtp.with_mtp(v3, 0) is v3
    added = token_flops(longer, 4096, 1).total - token_flops(v3, 4096).total
    block = mfu_flops_per_token(longer, 4096) - mfu_flops_per_token(v3, 4096)
    assert added == pytest.approx(block + 6 * (2 * v3.d_model ** 2 + v3.d_model * v3.vocab_size))
    stored = count_params(longer) - count_params(v3) + mtp.head_params(v3, 1, 1) + 2 * v3.vocab_size * v3.d_model
    assert round(count_params(v3) / 1e9) == 671 and 13e9 <= stored <= 15e9
    with pytest.raises(ValueError, match="--mtp-depth"):
        mtp.with_mtp(v3, 9)


def test_multi_token_predictions_weights_and_activations_sit_on_the_heads_rank():
    """The module's block is one more layer for the stages to split, its projection sits beside the head (under a
    V, on rank 0): over the ranks the weights grow by exactly the block and the projection, the head's rank holds
    the projection; that rank's activations rise by one more head's."""
    cfg = get_preset("tiny", **MLA_MOE)
    longer = mtp.with_mtp(cfg, 1)
    block = count_params(longer) - count_params(cfg)
    for schedule, m in (("1f1b", 4), ("dualpipev", 8)):
        lay = Layout.of(pp=2, microbatches=m, schedule=schedule, virtual_stages=1)
        head = head_stage(schedule, 2)
        before = sum(sum(rank_params(cfg, lay, s).values()) for s in range(2))
        after = sum(sum(rank_params(longer, lay, s, mtp_depth=1).values()) for s in range(2))
        assert after - before == block + mtp.head_params(cfg, 1, 1), schedule
        for stage in range(2):
            with_module, without = (sum(rank_params(longer, lay, stage, d).values()) for d in (1, 0))
            projection = with_module - without
            assert projection == (mtp.head_params(cfg, 1, 1) if stage == head else 0), (schedule, stage)
        a = estimate_memory(longer, lay, 256, 1, BF16_MEGATRON, stage=head, mtp_depth=1)
        b = estimate_memory(longer, lay, 256, 1, BF16_MEGATRON, stage=head)
        assert a.activations - b.activations == pytest.approx(mtp.head_activation_bytes(cfg, 256, 1, 2))


def test_mtp_depth_on_the_command_line(capsys):
    """--mtp-depth 1 plans (the report names it); out of range: one line, exit 2."""
    args = ["--model", "tiny", "--gpus", "4", "--seq-len", "256", "--global-batch-tokens", "16K"]
    assert main([*args, "--mtp-depth", "1"]) == 0
    assert "multi-token prediction, 1 module(s)" in capsys.readouterr().out
    assert main([*args, "--mtp-depth", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--mtp-depth must be in 0..8" in err
