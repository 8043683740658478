"""Grade chapter 01's exercises: parameters and FLOPs of a mixture-of-experts model, and days to train.

`pytest tests/exercises -k ch01` grades solutions/ (the default); add `--impl exercises` to grade your own answers.
The oracles are independent of any formula: the parameters of a model built on the meta device, PyTorch's
FlopCounterMode on a real forward and backward pass, and training times published by Narayanan et al. 2021.
"""

import math

import pytest
import torch
from grading import explain, load
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from minidist.model import Transformer, build_model, get_preset, lm_loss
from minidist.model.moe.layer import MoELayer

MODULE = "ch01_flops"
pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(d_model=32, n_heads=4, d_ff=64, vocab_size=96, max_seq_len=24)
# The tiny preset is Llama-style (GQA with 2 kv heads, SwiGLU, RMSNorm, RoPE); GPT-style is MHA with GELU,
# LayerNorm with biases, learned positions and tied embeddings.
GPT_STYLE = dict(n_kv_heads=4, mlp="gelu", norm="layernorm", bias=True, position="learned", tie_embeddings=True)
CASES = {
    "llama-style MoE": get_preset("tiny", **SMALL, n_layers=2, moe=dict(n_experts=4, top_k=2, d_expert=16)),
    "shared expert, first block dense": get_preset("tiny", **SMALL, n_layers=3, moe=dict(
        n_experts=4, top_k=1, n_shared_experts=1, first_dense_layers=1)),
    "gpt-style MoE (biases, learned positions, tied)": get_preset("tiny", **SMALL, **GPT_STYLE, n_layers=2, moe=dict(
        n_experts=6, top_k=2, d_expert=16, n_shared_experts=2, first_dense_layers=1)),
    "dense gpt-style": get_preset("tiny", **SMALL, **GPT_STYLE, n_layers=2),
    "dense llama-style, untied": get_preset("tiny", **SMALL, n_layers=2),
}


def _on_meta(cfg) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg)


def _pieces(model: Transformer) -> dict[str, int]:
    """Pieces of the built model an answer can miss or add, by size, to name in a failure message."""
    cfg, moe_layers = model.cfg, [m for m in model.modules() if isinstance(m, MoELayer)]

    def numel(keep) -> int:
        return sum(p.numel() for name, p in model.named_parameters() if keep(name))

    expert = sum(w[0].numel() for m in moe_layers[:1] for w in (m.experts.w1, m.experts.w3, m.experts.w2))
    return {
        "the learned position embedding": numel(lambda n: n.startswith("pos_emb")),
        "the output projection (lm_head; when tied it is the embedding, one parameter)": cfg.d_model * cfg.vocab_size,
        "the biases of the attention output projections (wo)": numel(lambda n: n.endswith("attn.wo.bias")),
        "the biases of the attention q/k/v projections": numel(lambda n: n.endswith(("wq.bias", "wk.bias", "wv.bias"))),
        "the biases of the dense MLPs": numel(lambda n: "mlp" in n and n.endswith("bias")),
        "the norms (gains, and biases of a LayerNorm with bias=True)": numel(lambda n: "norm" in n),
        "the final norm": numel(lambda n: n.startswith("norm.")),
        "the routers (d_model × n_experts per MoE layer)": sum(m.router.weight.numel() for m in moe_layers),
        "the shared experts": sum(p.numel() for m in moe_layers if m.shared is not None for p in m.shared.parameters()),
        "one routed expert per MoE layer": expert * len(moe_layers),
        "the dense first blocks' MLPs": sum(p.numel() for b in model.blocks if not isinstance(b.mlp, MoELayer)
                                             for p in b.mlp.parameters()),
    }


@pytest.mark.parametrize("case", CASES)
def test_ch01_moe_param_counts(impl: str, case: str) -> None:
    moe_param_counts = load(impl, MODULE, "moe_param_counts")
    cfg = CASES[case]
    model = _on_meta(cfg)
    built = sum(p.numel() for p in model.parameters())  # a tied weight is one parameter
    # A token skips the n_experts - top_k routed experts it is not sent to, in every MoE layer.
    skipped = sum((m.n_experts - m.top_k) * sum(w[0].numel() for w in (m.experts.w1, m.experts.w3, m.experts.w2))
                  for m in model.modules() if isinstance(m, MoELayer))
    total, active = moe_param_counts(cfg)
    hint = explain(total - built, _pieces(model))
    assert total == built, f"moe_param_counts({case}): total {total:,}, but the built model has {built:,}{hint}"
    hint = explain(active - (built - skipped), _pieces(model))
    assert active == built - skipped, (
        f"moe_param_counts({case}): active {active:,}, expected {built - skipped:,} (all parameters minus the "
        f"{skipped:,} of the routed experts a token is not sent to){hint}")


def _counted_flops_per_token(cfg, batch: int = 2, seq: int = 16) -> float:
    model = build_model(cfg)
    for module in model.modules():
        if hasattr(module, "backend"):
            module.backend = "loop"  # torch._grouped_mm has no formula in FlopCounterMode; the per-expert loop has
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    # The math backend runs attention as visible bmm's over the full T×T scores, as the exercise counts them.
    with counter, sdpa_kernel(SDPBackend.MATH):
        lm_loss(model(tokens), tokens).backward()
    return counter.get_total_flops() / tokens.numel()


@pytest.mark.parametrize("case", CASES)
def test_ch01_moe_flops_per_token(impl: str, case: str) -> None:
    moe_flops_per_token = load(impl, MODULE, "moe_flops_per_token")
    cfg, seq = CASES[case], 16
    counted = _counted_flops_per_token(cfg, seq=seq)
    got = moe_flops_per_token(cfg, seq)
    model, d = _on_meta(cfg), cfg.d_model
    pieces = _pieces(model)
    # FLOPs come from matmul weights (6 per weight and token); lookups, biases and norms cost none.
    free = ("bias", "norm", "position")
    weights = {name: 6 * size for name, size in pieces.items() if not any(word in name for word in free)}
    missing = {**weights, "the attention scores and values (12·L·H·Q·T)": 12 * cfg.n_layers * d * seq}
    extra = {**weights,
             "the token embedding (a table lookup: no FLOPs)": 6 * cfg.vocab_size * d,
             "the learned position embedding (a lookup too)": 6 * pieces["the learned position embedding"],
             "the biases and norms (elementwise, not matmuls)": 6 * sum(
                 size for name, size in pieces.items() if name.startswith(("the biases", "the norms"))),
             "the routed experts a token is not sent to": 6 * sum(
                 (m.n_experts - m.top_k) * sum(w[0].numel() for w in (m.experts.w1, m.experts.w3, m.experts.w2))
                 for m in model.modules() if isinstance(m, MoELayer))}
    assert got == counted, (f"moe_flops_per_token({case}, T={seq}): got {got:,}, FlopCounterMode counts {counted:,.0f} "
                            f"per token on a forward + backward pass{explain(got - counted, missing, extra)}")


def test_ch01_training_days_reproduces_megatron(impl: str) -> None:
    """Narayanan et al. 2021 (Megatron-LM at scale), §5.1: with activation recomputation a run takes about 8·T·P/(n·X)
    seconds. GPT-3 (175B parameters, 300B tokens) on 1024 A100s at 140 TFLOP/s each: about 34 days; the
    "trillion-parameter" model of their Table 1 (1,008B parameters, 450B tokens) on 3072 A100s at 163 TFLOP/s: 84."""
    training_days = load(impl, MODULE, "training_days")
    for name, args, published in [("GPT-3", (175e9, 300e9, 1024, 140e12), 34),
                                  ("1T", (1008e9, 450e9, 3072, 163e12), 84)]:
        got = training_days(*args, recompute=True)
        assert math.isclose(got, published, rel_tol=0.01), (
            f"training_days({name}, recompute=True): got {got:.1f} days, Narayanan et al. report about {published} — "
            "is it 8 FLOPs per parameter and token with recomputation, and seconds → days (86,400 s)?")


def test_ch01_training_days_is_6ND_over_throughput(impl: str) -> None:
    training_days = load(impl, MODULE, "training_days")
    # GPT-3's 3.14e23 FLOPs (Brown et al. 2020, Table D.1) at a sustained 1 PFLOP/s take 3.64e3 petaflop/s-days.
    got = training_days(175e9, 300e9, 1, 1e15)
    assert math.isclose(got, 6 * 175e9 * 300e9 / 1e15 / 86400, rel_tol=1e-9), (
        f"training_days(GPT-3, 1 GPU at 1 PFLOP/s): got {got:.4g} days, expected {6 * 175e9 * 300e9 / 1e15 / 86400:.4g}"
        " (6·N·D FLOPs without recomputation)")
    # Twice the GPUs at the same per-GPU throughput: half the time.
    one, two = training_days(7e9, 2e12, 512, 150e12), training_days(7e9, 2e12, 1024, 150e12)
    assert math.isclose(one, 2 * two, rel_tol=1e-12), f"training_days: 512 GPUs {one:.3f} days, 1024 GPUs {two:.3f}"
    with_recompute = training_days(7e9, 2e12, 512, 150e12, recompute=True)
    assert math.isclose(with_recompute, one * 8 / 6, rel_tol=1e-12), (
        f"training_days: recompute=True gives {with_recompute:.3f} days against {one:.3f} without; a recomputed "
        "forward adds 2 FLOPs per parameter and token to the 6, so the ratio is 8/6")
