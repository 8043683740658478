"""Tests for minidist.flops against built models, torch's FLOP counter, and numbers published in papers."""

import importlib.util
import math

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from minidist import flops
from minidist.flops import (
    attention_flops_per_token,
    count_params,
    flops_per_token,
    kaplan_flops_per_token,
    matmul_params,
    measure_matmul_peak,
    mfu,
    palm_flops_per_token,
    training_flops,
)
from minidist.hardware import peak_flops
from minidist.model import PRESETS, Transformer, build_model, get_preset, lm_loss
from minidist.model.config import MLAConfig, ModelConfig, MoEConfig

VARIANTS = {
    "tiny": get_preset("tiny"),
    "tiny-mqa": get_preset("tiny", n_kv_heads=1),
    "tiny-gpt2-style": get_preset("tiny", mlp="gelu", norm="layernorm", bias=True, position="learned",
                                  tie_embeddings=True),
    "tiny-gelu-no-bias": get_preset("tiny", mlp="gelu", norm="layernorm"),
}

# DeepSeek-V2 (DeepSeek-AI 2024, Table/§ "Model Hyper-Parameters" and the released configs) and DeepSeek-V3
# (DeepSeek-AI 2024, §4.2): MLA + MoE. Published: total parameters, and parameters activated per token.
DEEPSEEK = {
    "deepseek-v3": (ModelConfig(
        vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, d_ff=18432, attention="mla",
        mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(n_experts=256, top_k=8, n_shared_experts=1, d_expert=2048, first_dense_layers=3)), 671e9, 37e9),
    "deepseek-v2": (ModelConfig(
        vocab_size=102400, d_model=5120, n_layers=60, n_heads=128, d_ff=12288, attention="mla",
        mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(n_experts=160, top_k=6, n_shared_experts=2, d_expert=1536, first_dense_layers=1)), 236e9, 21e9),
    "deepseek-v2-lite": (ModelConfig(
        vocab_size=102400, d_model=2048, n_layers=27, n_heads=16, d_ff=10944, attention="mla",
        mla=MLAConfig(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        moe=MoEConfig(n_experts=64, top_k=6, n_shared_experts=2, d_expert=1408, first_dense_layers=1)), 15.7e9, 2.4e9),
}


def numel_on_meta(cfg: ModelConfig) -> int:
    """sum(p.numel()) of the model built on the meta device: exact shapes, no memory, so even 175B builds."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------------------------------
# parameter counts


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_count_params_equals_the_built_model_for_every_preset(name):
    cfg = get_preset(name)
    assert count_params(cfg) == numel_on_meta(cfg)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_count_params_equals_a_really_built_model(name):
    cfg = VARIANTS[name]
    model = build_model(cfg)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters())
    # Non-embedding count: drop the token and position tables and an untied output projection.
    embed = model.tok_emb.weight.numel() + (model.pos_emb.weight.numel() if model.pos_emb is not None else 0)
    if not cfg.tie_embeddings:
        embed += model.lm_head.weight.numel()
    assert count_params(cfg, include_embeddings=False) == count_params(cfg) - embed


@pytest.mark.parametrize("name, published", [
    ("gpt2-124m", 124_439_808),  # Hugging Face "gpt2" checkpoint (tied embeddings)
    ("llama2-7b", 6_738_415_616),  # meta-llama/Llama-2-7b-hf
    ("llama3-8b", 8_030_261_248),  # meta-llama/Meta-Llama-3-8B
    ("llama2-70b", 68_976_648_192),  # meta-llama/Llama-2-70b-hf
])
def test_count_params_equals_published_checkpoint_sizes(name, published):
    assert count_params(get_preset(name)) == published


def test_kaplan_non_embedding_count_is_about_12_L_d2_for_gpt3():
    """Kaplan et al. 2020, eq. 2.1: N ≈ 2·d·L·(2·d_attn + d_ff) = 12·L·d² when d_attn = d, d_ff = 4d."""
    cfg = get_preset("gpt3-175b")
    n = count_params(cfg, include_embeddings=False)
    assert n == pytest.approx(12 * cfg.n_layers * cfg.d_model**2, rel=1e-3)


@pytest.mark.parametrize("name", sorted(DEEPSEEK))
def test_mla_moe_counts_match_deepseek_published_totals(name):
    cfg, total, activated = DEEPSEEK[name]
    assert count_params(cfg) == pytest.approx(total, rel=5e-3)
    # DeepSeek's "activated" parameters leave out the input embedding (a lookup), as matmul_params does.
    assert matmul_params(cfg, active_only=True) == pytest.approx(activated, rel=3e-2)


def test_moe_total_minus_active_is_the_unused_experts():
    cfg = get_preset("tiny", moe=dict(n_experts=8, top_k=2, n_shared_experts=1, d_expert=64, first_dense_layers=1))
    moe_layers = cfg.n_layers - 1
    unused = moe_layers * (8 - 2) * 3 * cfg.d_model * 64
    assert count_params(cfg) - count_params(cfg, active_only=True) == unused
    dense = get_preset("tiny")
    assert count_params(dense, active_only=True) == count_params(dense)


HAS_MOE = importlib.util.find_spec("minidist.model.moe") is not None
HAS_MLA = importlib.util.find_spec("minidist.model.mla") is not None
MOE = dict(n_experts=4, top_k=2, n_shared_experts=1, d_expert=64, first_dense_layers=1)
MLA = dict(q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)


@pytest.mark.skipif(not HAS_MOE, reason="minidist.model.moe not written yet")
def test_moe_count_equals_the_built_moe_model():
    cfg = get_preset("tiny", moe=MOE)
    assert count_params(cfg) == numel_on_meta(cfg)


@pytest.mark.skipif(not HAS_MLA, reason="minidist.model.mla not written yet")
@pytest.mark.parametrize("q_lora_rank", [None, 48])
def test_mla_count_equals_the_built_mla_model(q_lora_rank):
    cfg = get_preset("tiny", attention="mla", mla={**MLA, "q_lora_rank": q_lora_rank})
    assert count_params(cfg) == numel_on_meta(cfg)


# ------------------------------------------------------------------------------------------------------------------
# FLOPs against torch's counter


def counted_flops(model, tokens, backward=True):
    """FlopCounterMode's total for one forward (+ backward). The math SDPA backend runs attention as bmm's, which
    the counter sees; the CPU flash kernel has no FLOP formula registered in torch 2.13 and would count as 0."""
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        loss = lm_loss(model(tokens), tokens)
        if backward:
            loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", ["tiny", "tiny-gpt2-style"])  # GQA/SwiGLU/RMSNorm and MHA/GELU/LayerNorm/tied
def test_flops_per_token_equals_flop_counter_on_forward_and_backward(name):
    cfg = VARIANTS[name].replace(n_layers=2)
    model = build_model(cfg)
    batch, seq = 2, 32
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq))
    assert counted_flops(model, tokens) == flops_per_token(cfg, seq) * batch * seq
    # Backward = 2 × forward: the forward alone is a third.
    assert counted_flops(model, tokens, backward=False) * 3 == flops_per_token(cfg, seq) * batch * seq


@pytest.mark.skipif(not (HAS_MOE and HAS_MLA), reason="minidist.model.moe / mla not written yet")
def test_flops_per_token_equals_flop_counter_for_mla_and_moe():
    """MLA: scores over nope+rope dims, values over v dims. MoE: router + top_k routed + shared experts per token
    (dropless). The experts run their per-expert loop here: torch._grouped_mm has no formula in FlopCounterMode."""
    cfg = get_preset("tiny", n_layers=2, attention="mla", mla=MLA, moe=MOE)
    model = build_model(cfg)
    for module in model.modules():
        if hasattr(module, "backend"):
            module.backend = "loop"
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    assert counted_flops(model, tokens) == flops_per_token(cfg, 32) * tokens.numel()


def test_flops_per_token_is_6N_plus_palm_attention_term():
    cfg = get_preset("llama2-7b")
    T = 4096
    L, H, Q = cfg.n_layers, cfg.n_heads, cfg.head_dim
    assert flops_per_token(cfg, T) == 6 * matmul_params(cfg) + 12 * L * H * Q * T
    assert attention_flops_per_token(cfg, T, causal=True) == 6 * L * T * H * Q  # Kaplan's (causal) term
    assert flops_per_token(cfg, T, causal=True) == flops_per_token(cfg, T) - 6 * L * T * H * Q


def test_megatron_formula_for_gpt3():
    """Narayanan et al. 2021 (Megatron-LM at scale): F = 96·B·s·l·h²·(1 + s/6h + V/16lh) per iteration, with activation
    recomputation (one extra forward of the transformer layers, not of the output layer). Per token and without
    recomputation it is 72·l·h²·(1 + s/6h + V/12lh): exactly our flops_per_token for a GPT-3 shaped model."""
    cfg = get_preset("gpt3-175b")
    s, n_layers, h, V = 2048, cfg.n_layers, cfg.d_model, cfg.vocab_size
    ours = flops_per_token(cfg, s)
    assert ours == pytest.approx(72 * n_layers * h**2 * (1 + s / (6 * h) + V / (12 * n_layers * h)), rel=1e-12)
    recompute = (ours - 6 * V * h) / 3  # one more forward of the layers
    megatron = 96 * n_layers * h**2 * (1 + s / (6 * h) + V / (16 * n_layers * h))
    assert ours + recompute == pytest.approx(megatron, rel=1e-12)


def test_kaplan_convention_drops_output_layer_and_halves_attention():
    cfg = get_preset("gpt2-124m")
    T = 1024
    n = count_params(cfg, include_embeddings=False)
    assert kaplan_flops_per_token(cfg, T) == 6 * n + attention_flops_per_token(cfg, T, causal=True)


# ------------------------------------------------------------------------------------------------------------------
# published training totals and MFU


def test_gpt3_training_compute():
    """Brown et al. 2020, Table D.1: GPT-3 175B, 300B tokens, 3.64e3 petaflop/s-days = 3.14e23 FLOPs."""
    published = 3.64e3 * 1e15 * 86400
    assert published == pytest.approx(3.14e23, rel=2e-3)
    assert training_flops(count_params(get_preset("gpt3-175b")), 300e9) == pytest.approx(published, rel=1e-2)


@pytest.mark.parametrize("n_params, n_tokens, published", [
    # Hoffmann et al. 2022 (Chinchilla), Table 3: compute-optimal tokens and FLOPs per model size. (The 67B row,
    # 5.76e23 FLOPs with "1.5 trillion" tokens, is off by 5% from 6·N·D because of how its token count is rounded.)
    (400e6, 8.0e9, 1.92e19), (1e9, 20.2e9, 1.21e20), (10e9, 205.1e9, 1.23e22), (175e9, 3.7e12, 3.85e24),
    (280e9, 5.9e12, 9.90e24), (520e9, 11.0e12, 3.43e25), (1e12, 21.2e12, 1.27e26), (10e12, 216.2e12, 1.30e28),
    # Chowdhery et al. 2022 (PaLM), compute-usage table: PaLM 540B on 780B tokens, 2527.2 zettaFLOPs.
    (540e9, 780e9, 2527.2e21),
])
def test_published_training_compute_is_6ND(n_params, n_tokens, published):
    assert training_flops(n_params, n_tokens) == pytest.approx(published, rel=1.5e-2)


def test_palm_540b_mfu():
    """PaLM, §4 / Appendix B: 540B (L=118, H=48, Q=256, T=2048), 238.3K tokens/s on 6144 TPU v4 chips: MFU 46.2%."""
    per_token = palm_flops_per_token(540.35e9, n_layers=118, n_heads=48, head_dim=256, seq_len=2048)
    assert mfu(238.3e3, per_token, 6144 * peak_flops("TPUv4")) == pytest.approx(0.462, abs=2e-3)


def test_peak_table_and_errors():
    assert peak_flops("H100-SXM") == peak_flops("H200-SXM") > peak_flops("A100") == 312e12
    with pytest.raises(ValueError, match="measure_matmul_peak") as info:
        peak_flops("cpu")
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(get_preset("tiny"), 0)
    with pytest.raises(ValueError, match="peak_flops"):
        mfu(1.0, 1.0, 0.0)


def test_measure_matmul_peak_is_a_plausible_matmul_rate():
    peak, _ = measure_matmul_peak([(256, 256, 256)], torch.float32, min_seconds=0.1)
    # 2·256³ = 33.5 MFLOP: any machine this runs on does it in well under a second, and no CPU reaches 100 TFLOP/s.
    assert 2 * 256**3 / 1.0 < peak < 100e12


def test_mfu_is_the_ratio_of_achieved_to_peak():
    assert mfu(1000.0, 6e9, 12e12) == pytest.approx(0.5)
    assert math.isclose(flops.mfu(2.0, 3.0, 6.0), 1.0)
