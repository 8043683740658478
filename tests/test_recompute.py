"""Activation recomputation (--recompute full, selective): the same losses and gradients as keeping every
activation, and the activation memory of full recomputation is one [B, T, d] block input per block, of selective
the memory model's, measured by tensor accounting."""

import pytest
import torch

from minidist.memory import LiveTensorBytes
from minidist.model import build_model, get_preset, lm_loss
from minidist.train import loop as train
from minidist.train.blocks import apply_recompute
from tests.test_train import small_config

MODEL = {"d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128, "max_seq_len": 64}


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> dict:
    """The trainer keeping every activation: the run each recomputation is compared with."""
    return train.train(small_config(tmp_path_factory.mktemp("plain"), steps=3, eval_every=0))


def test_recompute_matches_keeping_activations_in_the_trainer(tmp_path, plain):
    recomputed = train.train(small_config(tmp_path / "recomputed", steps=3, eval_every=0, recompute="full"))
    assert recomputed["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    assert recomputed["param_hash"] == plain["param_hash"]  # the same updates, bit for bit


def test_recompute_keeps_names_and_gradients():
    cfg = get_preset("tiny", n_layers=2, **MODEL)
    plain, recomputed = build_model(cfg), apply_recompute(build_model(cfg))
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in recomputed.named_parameters()]
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    for model in (plain, recomputed):
        lm_loss(model(tokens), tokens).backward()
    for (name, a), b in zip(plain.named_parameters(), recomputed.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)


def _activation_bytes(n_layers: int, recompute: bool | str, batch: int, seq: int) -> int:
    """Bytes of the tensors created by a forward that are still alive when it ends (what the backward needs);
    recompute: False/"none", True/"full" or "selective"."""
    model = build_model(get_preset("tiny", n_layers=n_layers, **MODEL))
    mode = {False: "none", True: "full"}.get(recompute, recompute)
    if mode != "none":
        apply_recompute(model, mode)
    tokens = torch.randint(0, 256, (batch, seq))
    with LiveTensorBytes() as memory:
        loss = lm_loss(model(tokens), tokens)
    assert loss.requires_grad
    return memory.current


def test_recompute_activation_memory_is_one_block_input_per_block():
    B, T, d = 2, 32, MODEL["d_model"]
    per_block = {rec: (_activation_bytes(4, rec, B, T) - _activation_bytes(2, rec, B, T)) // 2
                 for rec in (False, True)}
    assert per_block[True] == B * T * d * 4  # the formula: each block keeps its fp32 input, nothing else
    # Keeping every activation: norms, q/k/v, attention output and statistics, the four [B, T, d_ff] SwiGLU
    # tensors, residuals; about 18 block inputs on this shape.
    assert per_block[False] > 10 * per_block[True]


def _small_moe():
    """A two-block MoE model's config (capacity-limited, with the aux-free bias) and a fixed batch of tokens."""
    cfg = get_preset("tiny", n_layers=2, **{**MODEL, "d_model": 32, "d_ff": 64},
                     moe=dict(n_experts=4, top_k=2, d_expert=32, capacity_factor=1.0, bias_update_speed=0.01))
    return cfg, torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("early_stop", [True, False])
def test_recompute_counts_each_moe_routing_once(early_stop):
    # torch's replay may stop once every saved tensor is rebuilt (early stop), before the counts; without early stop
    # (or with an operation order that saves a tensor after them) it would count every routing a second time.
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from minidist.model.moe.stats import moe_layers, update_router_biases

    cfg, tokens = _small_moe()
    counted = []
    for recompute in (False, True):
        model = build_model(cfg)
        if recompute:
            apply_recompute(model)
        with set_checkpoint_early_stop(early_stop):
            (lm_loss(model(tokens), tokens) + model.aux_loss()).backward()
        layers = moe_layers(model)
        counts = [(m.tokens_per_expert.clone(), m.step_sums.clone()) for m in layers]
        update_router_biases(model)
        counted.append((counts, [m.router_bias.clone() for m in layers]))
    (plain, plain_bias), (again, again_bias) = counted
    for (tokens_a, sums_a), (tokens_b, sums_b) in zip(plain, again):
        torch.testing.assert_close(tokens_b, tokens_a, rtol=0, atol=0)
        torch.testing.assert_close(sums_b, sums_a, rtol=0, atol=0)
    for a, b in zip(plain_bias, again_bias):
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def _layer_bytes_of_the_model(recompute: str, B: int, T: int) -> float:
    from minidist.parallel import Layout
    from minidist.plan.rank_memory import FP32, activation_bytes

    cfg = get_preset("tiny", n_layers=2, **MODEL)
    layout = Layout.of(recompute=recompute)
    return activation_bytes(cfg, layout, T, B, FP32)[0]


def test_selective_recompute_matches_keeping_activations_in_the_trainer(tmp_path, plain):
    """--recompute selective: the same losses and the same parameters, bit for bit (the element-wise operators run
    again on the same inputs), as keeping every activation."""
    selective = train.train(small_config(tmp_path / "selective", steps=3, eval_every=0, recompute="selective"))
    assert selective["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    assert selective["param_hash"] == plain["param_hash"]


def test_selective_recompute_keeps_gradients_exactly():
    cfg = get_preset("tiny", n_layers=2, **MODEL)
    plain, selective = build_model(cfg), apply_recompute(build_model(cfg), "selective")
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    for model in (plain, selective):
        lm_loss(model(tokens), tokens).backward()
    for (name, a), b in zip(plain.named_parameters(), selective.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)


def test_selective_recompute_memory_is_the_models():
    """Measured bytes per block (tensor accounting) under each mode, next to the memory model's
    (`plan.rank_memory`): selective keeps the block's input and its matmul and attention outputs, 10 block inputs
    and the fp32 log-sum-exp on this shape, against about 18 without recomputation and 1 with full."""
    B, T, d = 2, 32, MODEL["d_model"]
    measured = {mode: (_activation_bytes(4, mode, B, T) - _activation_bytes(2, mode, B, T)) // 2
                for mode in ("none", "selective")}
    # the model's per-block figure: two blocks' worth over the two-layer model, less nothing (head is per stage)
    modelled = {mode: (_layer_bytes_of_the_model(mode, B, T) - _layer_bytes_of_the_model("full", B, T)) / 2
                + B * T * d * 4 for mode in ("none", "selective")}
    assert measured["selective"] == modelled["selective"] == B * T * (10 * d * 4 + 4 * MODEL["n_heads"])
    assert measured["none"] == pytest.approx(modelled["none"], rel=0.05)
    assert measured["selective"] < 0.6 * measured["none"]


def test_selective_recompute_with_context_parallel_is_refused(tmp_path):
    from minidist.train.config import ConfigError

    with pytest.raises(ConfigError, match="--recompute selective with --cp > 1"):
        train.train(small_config(tmp_path / "cp", steps=1, recompute="selective", cp=2))


def test_selective_recompute_of_moe_blocks_counts_each_routing_once():
    """An MoE block under the selective policy replays its routing under `Replaying` too: the same gradients bit
    for bit and the same tokens per expert as keeping every activation (a second count would double them)."""
    from minidist.model.moe.stats import moe_layers

    cfg, tokens = _small_moe()
    runs = []
    for selective in (False, True):
        model = build_model(cfg)
        if selective:
            apply_recompute(model, "selective")
        (lm_loss(model(tokens), tokens) + model.aux_loss()).backward()
        runs.append((model, [m.tokens_per_expert.clone() for m in moe_layers(model)]))
    (plain, plain_counts), (again, again_counts) = runs
    for (name, a), b in zip(plain.named_parameters(), again.parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=0, atol=0, msg=name)
    for a, b in zip(plain_counts, again_counts):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
