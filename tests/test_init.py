"""Tests for minidist.model.init: layout independence (value = f(seed, name)) and the statistics of the initial
weights."""

import importlib.util
import math

import pytest
import torch

from minidist.model import Transformer, build_model, get_preset
from minidist.model.init import (
    init_parameters,
    init_shard,
    init_std,
    init_value,
    kaiming_std,
    parameter_seed,
    residual_scale,
    xavier_std,
)

GPT2_STYLE = dict(mlp="gelu", norm="layernorm", bias=True, position="learned", tie_embeddings=True)
HAS_MOE_MLA = all(importlib.util.find_spec(m) is not None for m in ("minidist.model.moe", "minidist.model.mla"))


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------------------------------------------------------
# layout independence


def test_same_seed_gives_identical_models_and_different_seeds_differ():
    cfg = get_preset("tiny")
    a, b, c = state(build_model(cfg, seed=7)), state(build_model(cfg, seed=7)), state(build_model(cfg, seed=8))
    for name in a:
        assert torch.equal(a[name], b[name]), name
        if init_std(name, cfg) is None:
            assert torch.equal(a[name], c[name]), name  # constants do not depend on the seed
        else:
            corr = torch.corrcoef(torch.stack([a[name].flatten(), c[name].flatten()]))[0, 1].item()
            assert abs(corr) < 6 / math.sqrt(a[name].numel()), name  # independent draws


def test_values_do_not_depend_on_global_rng_or_construction_order():
    cfg = get_preset("tiny")
    torch.manual_seed(1)
    reference = state(build_model(cfg, seed=3))
    # A different global RNG state, an unrelated draw in between, and parameters filled in reverse order.
    torch.manual_seed(12345)
    torch.randn(1000)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in reversed(list(model.named_parameters())):
            p.copy_(init_value(name, p.shape, cfg, seed=3))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0)


def test_every_parameter_gets_its_own_stream():
    """Same-shaped parameters (wq of block 0 and block 1) must not share numbers: the seed includes the name."""
    cfg = get_preset("tiny")
    a = init_value("blocks.0.attn.wq.weight", (128, 128), cfg, 0).flatten()
    b = init_value("blocks.1.attn.wq.weight", (128, 128), cfg, 0).flatten()
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(corr) < 6 / math.sqrt(a.numel())
    seeds = {parameter_seed(s, n) for s in (0, 1) for n in ("a", "b", "blocks.0.attn.wq.weight")}
    assert len(seeds) == 6 and all(0 <= s < 2**63 for s in seeds)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("name, dim", [("blocks.0.attn.wq.weight", 0), ("blocks.0.attn.wo.weight", 1),
                                       ("tok_emb.weight", 0), ("blocks.0.mlp.w1.weight", 0)])
def test_a_shard_is_a_slice_of_the_full_value(world_size, name, dim):
    cfg = get_preset("tiny")
    full_model = build_model(cfg, seed=5)
    full = dict(full_model.named_parameters())[name].detach()
    shards = [init_shard(name, full.shape, cfg, 5, dim, r, world_size) for r in range(world_size)]
    for r, shard in enumerate(shards):
        # What a tensor-parallel rank holding rows (dim 0) or columns (dim 1) r of world_size would compute.
        rows = full.shape[dim] // world_size
        expected = full.narrow(dim, r * rows, rows)
        torch.testing.assert_close(shard, expected, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(shards, dim=dim), full, rtol=0, atol=0)


def test_a_sharded_linear_initialized_from_its_name_matches_the_full_model():
    """A column-parallel wq on 2 ranks: each rank builds a Linear with half the output rows and fills it."""
    cfg = get_preset("tiny")
    full = build_model(cfg, seed=9).blocks[2].attn.wq.weight.detach()
    name = "blocks.2.attn.wq.weight"
    for rank in range(2):
        local = torch.nn.Linear(cfg.d_model, cfg.d_model // 2, bias=False)
        with torch.no_grad():
            local.weight.copy_(init_shard(name, (cfg.d_model, cfg.d_model), cfg, 9, 0, rank, 2))
        torch.testing.assert_close(local.weight.detach(), full[rank * 64:(rank + 1) * 64], rtol=0, atol=0)


def test_init_shard_rejects_uneven_splits_in_one_line():
    with pytest.raises(ValueError, match="must divide") as info:
        init_shard("blocks.0.attn.wq.weight", (128, 128), get_preset("tiny"), 0, 0, 0, 3)
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------------------------
# statistics


def check_statistics(model, cfg):
    """Every random matrix has mean 0 and its intended std within sampling error; constants are exactly 1 or 0."""
    residual = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    seen_residual = 0
    for name, p in model.named_parameters():
        p = p.detach()
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "bias":
            assert torch.equal(p, torch.zeros_like(p)), name
            continue
        if "norm" in name.rsplit(".", 2)[-2]:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        is_residual = name.endswith(("attn.wo.weight", "mlp.w2.weight", "experts.w2", "shared.w2.weight"))
        intended = residual if is_residual else cfg.init_std
        seen_residual += is_residual
        n = p.numel()
        # The sample std of n normal draws has relative standard error 1/√(2n); the mean, std/√n. Allow 6 of each.
        assert p.std().item() == pytest.approx(intended, rel=6 / math.sqrt(2 * n)), name
        assert abs(p.mean().item()) < 6 * intended / math.sqrt(n), name
    return seen_residual


def test_weight_statistics_of_the_default_init():
    cfg = get_preset("tiny", n_layers=6)
    model = build_model(cfg, seed=0)
    assert check_statistics(model, cfg) == 2 * cfg.n_layers
    assert init_std("blocks.3.attn.wo.weight", cfg) == pytest.approx(cfg.init_std / math.sqrt(12))
    assert init_std("blocks.3.mlp.w1.weight", cfg) == cfg.init_std


def test_norms_are_ones_and_biases_zeros_in_a_gpt2_style_model():
    cfg = get_preset("tiny", **GPT2_STYLE)
    model = build_model(cfg, seed=0)
    names = dict(model.named_parameters())
    assert any(n.endswith("bias") for n in names) and any("norm" in n for n in names)
    assert check_statistics(model, cfg) == 2 * cfg.n_layers


@pytest.mark.skipif(not HAS_MOE_MLA, reason="minidist.model.moe / mla not written yet")
def test_statistics_of_an_mla_moe_model():
    cfg = get_preset("tiny", attention="mla", moe=dict(n_experts=4, top_k=2, n_shared_experts=1, d_expert=64),
                     mla=dict(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                              v_head_dim=16))
    model = build_model(cfg, seed=0)
    # Per MoE block: attention wo, routed experts' w2 and the shared expert's w2.
    assert check_statistics(model, cfg) == 3 * cfg.n_layers


def test_init_parameters_overwrites_torch_default_init():
    cfg = get_preset("tiny")
    model = Transformer(cfg)  # PyTorch's own (Kaiming-uniform) init, from the global RNG
    init_parameters(model, cfg, seed=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), init_value(name, p.shape, cfg, 0), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------------------------
# the textbook schemes, against torch.nn.init


@pytest.mark.parametrize("fan_in, fan_out", [(256, 256), (512, 128)])
def test_xavier_and_kaiming_std_match_torch_nn_init(fan_in, fan_out):
    g = torch.Generator().manual_seed(0)
    w = torch.empty(fan_out, fan_in)  # nn.Linear layout: [out, in]
    torch.nn.init.xavier_normal_(w, gain=torch.nn.init.calculate_gain("tanh"), generator=g)
    assert w.std().item() == pytest.approx(xavier_std(fan_in, fan_out, gain=5 / 3), rel=0.02)
    torch.nn.init.kaiming_normal_(w, mode="fan_in", nonlinearity="relu", generator=g)
    assert w.std().item() == pytest.approx(kaiming_std(fan_in), rel=0.02)
    assert kaiming_std(fan_in, gain=1.0) == pytest.approx(1 / math.sqrt(fan_in))
    assert residual_scale(12) == pytest.approx(1 / math.sqrt(24))
