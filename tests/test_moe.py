"""Tests for minidist.model.moe: the losses on hand-made routings, capacity and dropping, the bias update, sorted
dispatch against the boolean-mask loop, tie-breaking, validation, parameter counts, and a short training run."""

import math

import pytest
import torch
import torch.nn.functional as F

from minidist.model import build_model, get_preset, lm_loss
from minidist.model.config import ModelConfig
from minidist.model.moe.dispatch import expert_capacity, grouped_mm_works, plan_dispatch
from minidist.model.moe.layer import MoELayer, moe_forward_naive
from minidist.model.moe.routing import load_balancing_loss, route, router_z_loss, top_k_indices
from minidist.model.moe.stats import moe_stats, update_router_biases


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes: one thread is as fast as two here, and immune to the 5-50x slowdown of oversubscribed cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def moe_cfg(**moe) -> ModelConfig:
    base = dict(n_experts=4, top_k=2, d_expert=32)
    return get_preset("tiny", d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64,
                      moe={**base, **moe})


def moe_layer(seed: int = 0, **moe) -> MoELayer:
    """One MoE layer with random weights (bigger than the init's, so the routing is far from uniform)."""
    layer = MoELayer(moe_cfg(**moe))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


# ------------------------------------------------------------------------------------------------------------------
# balancing losses on hand-made routings


@pytest.mark.parametrize("n, k", [(4, 1), (8, 2), (6, 3)])
def test_balance_loss_is_one_for_uniform_routing(n, k):
    tokens = 4 * n
    probs = torch.full((tokens, n), 1.0 / n)
    # Token t picks experts t, t+1, ..., t+k-1 (mod n): every expert gets exactly tokens·k/n slots.
    indices = (torch.arange(tokens)[:, None] + torch.arange(k)[None, :]) % n
    assert load_balancing_loss(probs, indices, n).item() == pytest.approx(1.0, abs=1e-6)


def test_balance_loss_collapse_gives_n_for_top1_and_n_over_k_for_topk():
    n, tokens = 8, 16
    probs = F.one_hot(torch.zeros(tokens, dtype=torch.long), n).float()
    assert load_balancing_loss(probs, torch.zeros(tokens, 1, dtype=torch.long), n).item() == pytest.approx(n)
    # top-2, everything on experts 0 and 1, probabilities split between them
    probs = torch.zeros(tokens, n)
    probs[:, :2] = 0.5
    indices = torch.tensor([[0, 1]] * tokens)
    assert load_balancing_loss(probs, indices, n).item() == pytest.approx(n / 2)


def test_balance_loss_matches_formula_and_bound():
    gen = torch.Generator().manual_seed(1)
    n, k, tokens = 5, 2, 37
    probs = torch.randn(tokens, n, generator=gen).softmax(-1)
    indices = top_k_indices(torch.randn(tokens, n, generator=gen), k)
    f = [sum(int(e == i) for e in indices.flatten().tolist()) / (tokens * k) for i in range(n)]
    p = [probs[:, i].mean().item() for i in range(n)]
    expected = n * sum(fi * pi for fi, pi in zip(f, p))
    got = load_balancing_loss(probs, indices, n).item()
    assert got == pytest.approx(expected, rel=1e-6)
    assert 0 < got <= n / k + 1e-6  # Σ fᵢPᵢ <= max fᵢ <= 1/k


def test_layer_aux_loss_is_alpha_for_uniform_router():
    alpha = 0.037
    layer = moe_layer(n_experts=8, top_k=2, aux_loss_coef=alpha, z_loss_coef=0.0)
    with torch.no_grad():
        layer.router.weight.zero_()  # all logits 0: P uniform, so N·Σ fᵢ/N = 1 whatever f is
    layer(torch.randn(3, 5, 32))
    assert layer.aux_loss.item() == pytest.approx(alpha, rel=1e-6)
    assert layer.last_stats["balance_loss"] == pytest.approx(1.0, rel=1e-6)


def test_z_loss_by_hand():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0], [1.0, 2.0]])
    lse = [math.log(2.0), math.log(4.0), math.log(math.e + math.e**2)]
    expected = sum(v * v for v in lse) / 3
    assert router_z_loss(logits).item() == pytest.approx(expected, rel=1e-6)
    # [B, T, N] logits are flattened over tokens
    assert router_z_loss(logits.view(1, 3, 2)).item() == pytest.approx(expected, rel=1e-6)


def test_layer_aux_loss_weights_both_losses_and_reaches_the_router():
    layer = moe_layer(aux_loss_coef=0.1, z_loss_coef=0.01)
    layer(torch.randn(2, 8, 32))
    stats = layer.last_stats
    assert layer.aux_loss.item() == pytest.approx(0.1 * stats["balance_loss"] + 0.01 * stats["z_loss"], rel=1e-5)
    layer.aux_loss.backward()
    assert layer.router.weight.grad.abs().sum() > 0


# ------------------------------------------------------------------------------------------------------------------
# routers


def test_ties_lower_expert_index_wins():
    scores = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 3.0, 3.0, 1.0], [2.0, 5.0, 2.0, 2.0]])
    assert top_k_indices(scores, 2).tolist() == [[0, 1], [1, 2], [1, 0]]
    zero = torch.zeros(5, 6)
    for router in ("softmax", "sigmoid"):
        assert route(zero, 3, router).indices.tolist() == [[0, 1, 2]] * 5


def test_softmax_top1_keeps_probability_topk_renormalizes_like_mixtral():
    logits = torch.randn(7, 5, generator=torch.Generator().manual_seed(2))
    r1 = route(logits, 1, "softmax")
    assert torch.allclose(r1.weights[:, 0], logits.softmax(-1).max(-1).values)
    r2 = route(logits, 2, "softmax")
    top = logits.topk(2, dim=-1)
    assert torch.equal(r2.indices, top.indices)
    assert torch.allclose(r2.weights, top.values.softmax(-1), atol=1e-6)  # Mixtral: softmax over the top-k logits


def test_sigmoid_bias_changes_choice_not_gates():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    r = route(logits, 2, "sigmoid", bias=bias, scaling=2.5)
    assert r.indices.tolist() == [[3, 0]]
    s = torch.sigmoid(logits[0, [3, 0]])
    assert torch.allclose(r.weights[0], 2.5 * s / s.sum())
    assert torch.allclose(r.probs.sum(-1), torch.ones(1))


# ------------------------------------------------------------------------------------------------------------------
# capacity and dropping


def test_capacity_arithmetic():
    assert expert_capacity(64, 8, 2, 1.0) == 16
    assert expert_capacity(10, 4, 2, 1.25) == 7  # ⌈6.25⌉
    assert expert_capacity(100, 10, 1, 1.1) == 11  # not 12 from 11.000000000000002
    assert expert_capacity(3, 8, 1, 0.5) == 1
    assert expert_capacity(64, 8, 2, None) is None
    with pytest.raises(ValueError, match="capacity_factor"):
        expert_capacity(64, 8, 2, 0.0)


def test_dropping_keeps_first_choices_then_earlier_tokens():
    indices = torch.tensor([[0, 1], [1, 0], [0, 2], [3, 0]])  # 4 tokens, 4 experts, k=2
    weights = torch.rand(4, 2)
    capacity = expert_capacity(4, 4, 2, 0.5)
    assert capacity == 1
    plan = plan_dispatch(indices, weights, 4, capacity)
    kept = sorted((int(s) % 4, int(s) // 4) for s in plan.slot)  # (token, choice rank)
    # e0: t0's first choice beats t2's first choice and the second choices of t1, t3; e1: t1 (first) beats t0
    # (second); e2, e3: the only slot each.
    assert kept == [(0, 0), (1, 0), (2, 1), (3, 0)]
    assert plan.counts.tolist() == [1, 1, 1, 1] and plan.routed.tolist() == [4, 2, 1, 1]
    assert plan.dropped == 4
    assert torch.equal(plan.gate, weights.t().reshape(-1)[plan.slot])


def test_dropped_tokens_output_zero_and_drop_rate_reported():
    layer = moe_layer(n_experts=4, top_k=1, capacity_factor=1.0)
    x = torch.randn(1, 1, 32).expand(1, 12, 32)  # identical tokens: all pick the same expert
    y = layer(x)[0]
    capacity = expert_capacity(12, 4, 1, 1.0)  # 3
    assert torch.allclose(y[:capacity], y[:1].expand(capacity, -1))
    assert y[:capacity].abs().sum() > 0
    assert torch.equal(y[capacity:], torch.zeros_like(y[capacity:]))
    assert layer.last_stats["drop_rate"] == pytest.approx(1 - capacity / 12)


def test_capacity_is_per_sequence_in_priority_order():
    # 2 sequences of 3 tokens, 2 experts, top-1, capacity 1 per sequence: each sequence's first token wins
    indices = torch.tensor([[0], [0], [1], [0], [1], [1]])
    plan = plan_dispatch(indices, torch.ones(6, 1), 2, capacity=1, seq_len=3)
    assert sorted(plan.token.tolist()) == [0, 2, 3, 4]
    assert plan.counts.tolist() == [2, 2] and plan.dropped == 2
    # one sequence of 6: expert 0 keeps only token 0, expert 1 only token 2
    assert sorted(plan_dispatch(indices, torch.ones(6, 1), 2, capacity=1).token.tolist()) == [0, 2]


def _skewed_layer(**moe) -> MoELayer:
    layer = moe_layer(seed=7, n_experts=4, top_k=2, **moe).double()
    with torch.no_grad():
        layer.router.weight[0] += 0.4  # overload expert 0, so that a capacity factor of 1 drops
    return layer


def test_splitting_the_batch_changes_no_output_drop_or_balance_loss():
    """Micro-batches, data- and expert-parallel ranks all see whole sequences: the capacity and the balance loss
    must not depend on how many sequences one forward holds. (With capacity per forward call, the two halves
    dropped other slots than the whole batch and the outputs differed by ~1e-3.)"""
    layer = _skewed_layer(capacity_factor=1.0, aux_loss_coef=1.0)
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    whole = layer(x)
    aux_whole, drop_whole = layer.aux_loss.item(), layer.last_stats["drop_rate"]
    halves, aux_halves = [], []
    for half in x.split(2):
        halves.append(layer(half))
        aux_halves.append(layer.aux_loss.item())
    assert drop_whole > 0.02  # the case drops
    torch.testing.assert_close(torch.cat(halves), whole, rtol=1e-12, atol=1e-12)
    assert sum(aux_halves) / 2 == pytest.approx(aux_whole, rel=1e-12)
    # and the naive loop agrees on which slots are dropped, sequence by sequence
    torch.testing.assert_close(moe_forward_naive(layer, x), whole, rtol=1e-12, atol=1e-12)


def test_step_figures_of_two_halves_equal_those_of_the_whole_batch():
    cfg = moe_cfg(n_experts=4, top_k=2, capacity_factor=1.0, z_loss_coef=1e-3)
    model = build_model(cfg).double()
    for block in model.blocks:
        with torch.no_grad():
            block.mlp.router.weight[0] += 0.4
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(10))
    model(tokens)
    whole = moe_stats(model)
    for half in tokens.split(2):
        model(half)
    halves = moe_stats(model)
    assert whole["moe_drop_rate"] > 0 and whole.keys() == halves.keys()
    for key, value in whole.items():
        assert halves[key] == pytest.approx(value, rel=1e-12), key
    assert moe_stats(model) == {}  # read and reset: nothing routed since


# ------------------------------------------------------------------------------------------------------------------
# sorted dispatch == the naive boolean-mask loop, forward and backward

CASES = [
    dict(n_experts=4, top_k=1),
    dict(n_experts=4, top_k=2),
    dict(n_experts=8, top_k=2, n_shared_experts=1, capacity_factor=1.0),
    dict(n_experts=8, top_k=3, capacity_factor=0.5),
    dict(n_experts=6, top_k=3, router="sigmoid", routed_scaling_factor=2.5, n_shared_experts=2),
    dict(n_experts=6, top_k=2, router="sigmoid", capacity_factor=1.25),
]


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_dispatch_equals_naive_loop(case, backend):
    layer = moe_layer(seed=3, **case)
    layer.experts.backend = backend
    # float64 makes the comparison exact up to summation order; CPU grouped_mm only takes float32.
    dtype, tol = (torch.float32, dict(rtol=1e-4, atol=1e-5)) if backend == "grouped_mm" else (torch.float64, {})
    layer.to(dtype)
    if backend == "grouped_mm" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no torch._grouped_mm")
    with torch.no_grad():
        layer.router_bias.copy_(torch.randn(layer.n_experts) * 0.1)  # the selection bias takes part too
    x = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(4), dtype=dtype)
    grad_out = torch.randn_like(x)
    results = []
    for fn in (layer, lambda t: moe_forward_naive(layer, t)):
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y = fn(xi)
        y.backward(grad_out)
        results.append((y.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (y1, gx1, g1), (y2, gx2, g2) = results
    torch.testing.assert_close(y1, y2, **tol)
    torch.testing.assert_close(gx1, gx2, **tol)
    for name in g1:
        torch.testing.assert_close(g1[name], g2[name], **tol, msg=name)
    assert g1["router.weight"].abs().sum() > 0


# ------------------------------------------------------------------------------------------------------------------
# auxiliary-loss-free bias


def test_bias_update_signs_and_reset():
    gamma = 0.01
    model = build_model(moe_cfg(bias_update_speed=gamma))
    layers = [b.mlp for b in model.blocks]
    layers[0].tokens_per_expert.copy_(torch.tensor([5.0, 1.0, 3.0, 3.0]))
    layers[1].tokens_per_expert.copy_(torch.tensor([0.0, 2.0, 2.0, 8.0]))
    seen = []
    update_router_biases(model, reduce_fn=lambda t: (seen.append(t.clone()), t.mul_(2)))
    assert seen[0].tolist() == [5.0, 1.0, 3.0, 3.0, 0.0, 2.0, 2.0, 8.0]  # one tensor for all layers
    assert layers[0].router_bias.tolist() == pytest.approx([-gamma, gamma, 0.0, 0.0])
    assert layers[1].router_bias.tolist() == pytest.approx([gamma, gamma, gamma, -gamma])
    assert all(m.tokens_per_expert.abs().sum() == 0 for m in layers)
    assert "blocks.0.mlp.router_bias" in model.state_dict()
    assert "blocks.0.mlp.tokens_per_expert" not in model.state_dict()
    assert all(not n.endswith("router_bias") for n, _ in model.named_parameters())


def test_training_forwards_count_load_and_eval_does_not():
    layer = moe_layer(n_experts=4, top_k=2)
    layer.train()
    layer(torch.randn(2, 6, 32))
    layer(torch.randn(2, 6, 32))
    assert layer.tokens_per_expert.sum().item() == 2 * 12 * 2
    layer.eval()
    layer(torch.randn(2, 6, 32))
    assert layer.tokens_per_expert.sum().item() == 2 * 12 * 2


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_bias_updates_balance_a_skewed_router(router):
    layer = moe_layer(seed=5, n_experts=8, top_k=2, router=router, bias_update_speed=0.01)
    x = torch.randn(128, 32, generator=torch.Generator().manual_seed(6)).abs()
    with torch.no_grad():
        layer.router.weight[0] += 0.1  # a router that prefers expert 0 for most tokens
        layer(x)
        before = layer.last_stats["expert_load"].max().item() * 8
        imbalance = []
        for _ in range(100):
            layer(x)
            update_router_biases(layer)
            imbalance.append(layer.last_stats["expert_load"].max().item() * 8)
    # The sign rule cannot settle exactly (a constant step), it hovers near balance.
    assert before > 3.0 and max(imbalance[-20:]) < 1.4, (before, imbalance[-20:])
    assert layer.router_bias[0] < 0 and layer.router_bias.abs().max() > 0


# ------------------------------------------------------------------------------------------------------------------
# config validation


@pytest.mark.parametrize("moe, words", [
    (dict(n_experts=4, top_k=5), "top_k"),
    (dict(n_experts=4, top_k=0), "top_k"),
    (dict(n_experts=4, capacity_factor=0.0), "capacity_factor"),
    (dict(n_experts=4, capacity_factor=-1.0), "capacity_factor"),
    (dict(n_experts=4, router="cosine"), "router"),
    (dict(n_experts=4, d_expert=0), "d_expert"),
    (dict(n_experts=4, first_dense_layers=9), "first_dense_layers"),
    (dict(n_experts=4, routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(n_experts=-1), "n_experts"),
])
def test_bad_moe_config_one_line_error(moe, words):
    with pytest.raises(ValueError, match=words) as info:
        get_preset("tiny", moe=moe)
    assert "\n" not in str(info.value)


def test_dense_model_has_no_moe_stats():
    model = build_model(get_preset("tiny", d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64))
    model(torch.randint(0, 256, (1, 8)))
    assert moe_stats(model) == {}
    assert model.aux_loss().item() == 0.0


# ------------------------------------------------------------------------------------------------------------------
# parameter counts (minidist.flops is written by another chapter)


@pytest.mark.parametrize("moe", [
    dict(n_experts=4, top_k=2, d_expert=32),
    dict(n_experts=8, top_k=3, d_expert=16, n_shared_experts=2, first_dense_layers=1, router="sigmoid"),
])
def test_count_params_total_and_active(moe):
    flops = pytest.importorskip("minidist.flops")
    cfg = get_preset("tiny", d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=64, moe=moe)
    model = build_model(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert flops.count_params(cfg) == total
    # Active: the k of N routed experts a token uses; router and shared experts run for every token.
    routed = sum(m.experts.w1.numel() + m.experts.w2.numel() + m.experts.w3.numel() for m in model.modules()
                 if isinstance(m, MoELayer))
    inactive = routed * (moe["n_experts"] - moe["top_k"]) // moe["n_experts"]
    assert flops.count_params(cfg, active_only=True) == total - inactive


# ------------------------------------------------------------------------------------------------------------------
# a tiny MoE model trains


def test_tiny_moe_model_trains_and_reports_stats():
    torch.manual_seed(0)
    cfg = moe_cfg(n_experts=4, top_k=2, n_shared_experts=1, capacity_factor=1.25, aux_loss_coef=0.01,
                  z_loss_coef=1e-3, bias_update_speed=1e-3)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # A learnable stream: short repeated phrases with random starting offsets.
    text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 40))
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(40):
        starts = torch.randint(0, len(text) - 33, (8,), generator=gen)
        rows = torch.stack([text[s:s + 33] for s in starts.tolist()])
        logits = model(rows[:, :-1])
        loss = lm_loss(logits, rows[:, 1:])
        opt.zero_grad()
        (loss + model.aux_loss()).backward()
        opt.step()
        update_router_biases(model)
        losses.append(loss.item())
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:5]) / 5, losses
    stats = moe_stats(model)
    assert set(stats) >= {"moe_load_imbalance", "moe_drop_rate", "moe_balance_loss", "moe_z_loss"}
    assert 1.0 <= stats["moe_load_imbalance"] <= stats["moe_max_load_imbalance"] <= 4.0
    assert 0.0 <= stats["moe_drop_rate"] < 1.0
    assert 0.0 < stats["moe_balance_loss"] <= 4 / 2 and stats["moe_z_loss"] > 0.0
    biases = torch.stack([b.mlp.router_bias for b in model.blocks])
    assert biases.abs().sum() > 0


def test_grouped_mm_dtype_follows_autocast_and_cudas_contract_on_every_device():
    from minidist.model.moe.dispatch import grouped_mm_dtype

    f32, bf16 = torch.float32, torch.bfloat16
    for device in ("cuda", "cpu"):
        # the fp32 residual stream under bf16 autocast goes to grouped_mm in bf16, as autocast casts matmuls
        assert grouped_mm_dtype(f32, f32, device, autocast_dtype=bf16) == bf16
        assert grouped_mm_dtype(bf16, bf16, device) == bf16
        assert grouped_mm_dtype(bf16, bf16, device, aligned=False) is None  # rows not 16-byte aligned
        assert grouped_mm_dtype(f32, f32, device) is None  # no autocast: fp32 experts on the loop
        assert grouped_mm_dtype(f32, f32, device, autocast_dtype=torch.float16) is None
        assert grouped_mm_dtype(torch.float64, torch.float64, device) is None
    # aligned as bf16 rows: d = 8 is 16 bytes, d = 4 is 8 (the CPU kernel takes it in fp32; CUDA's rule does not)
    assert grouped_mm_works(torch.zeros(2, 8, dtype=bf16), torch.zeros(2, 8, 8, dtype=bf16))
    assert not grouped_mm_works(torch.zeros(2, 4, dtype=bf16), torch.zeros(2, 4, 8, dtype=bf16))


def test_the_compiled_grouped_mm_follows_cudas_rule_which_auto_follows_too():
    """torch.compile traces _grouped_mm with its meta function, CUDA's rule, on any device: fp32 fails at trace
    time, so "auto" takes the loop for fp32 (and the loop never recompiles: its sizes stay out of the graph)."""
    from minidist.model.moe.dispatch import Experts

    experts = Experts(2, 8, 16, backend="grouped_mm")
    with torch.no_grad():
        for weight in experts.parameters():
            weight.normal_()
    x, counts = torch.randn(6, 8), torch.tensor([2, 4])
    with pytest.raises(Exception, match="BF16"):
        torch.compile(experts, backend="aot_eager")(x, counts)
    torch._dynamo.reset()
    experts.backend = "auto"
    torch.testing.assert_close(torch.compile(experts, backend="aot_eager")(x, counts),
                               Experts.forward(experts, x, counts))


def test_expert_outputs_keep_the_residual_dtype_under_autocast():
    # Under bf16 autocast the loop's matmuls return bf16; the layer sums them into the fp32 stream (index_add
    # takes one dtype): before, an MoE layer on the loop under bf16 autocast raised there.
    layer = moe_layer(seed=1)
    layer.experts.backend = "loop"
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.float32
    reference = layer(x)
    assert (y - reference).norm() < 0.02 * reference.norm()  # bf16 rounding of the fp32 result
