"""Multi-head latent attention (chapter 05): the naive path against the paper's equations written out per head, the
absorbed path and cached decoding against the naive path (fp64), KV-cache numbers against DeepSeek-V2 Table 1,
parameter names and init, bad input, and a tiny MLA model that trains."""

import math

import pytest
import torch

from minidist.model import build_model, get_preset, lm_loss
from minidist.model.init import init_std
from minidist.model.kv_cache import (
    LatentKVCache,
    attention_kind,
    kv_cache_bytes,
    kv_cache_elements_per_token,
    kv_cache_elements_per_token_per_layer,
)
from minidist.model.mla import MLA_REFERENCE_CONFIGS, MultiHeadLatentAttention, mla_reference_config
from minidist.model.rope import apply_rotary, rope_cos_sin, rope_for_config

MLA = dict(kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10)



def mla_cfg(q_lora_rank=None, scaling=None, layout="half", **kw):
    return get_preset("tiny", d_model=64, n_heads=4, n_kv_heads=4, attention="mla", rope_layout=layout,
                      mla=dict(MLA, q_lora_rank=q_lora_rank), rope_scaling=scaling or dict(kind="none"), **kw)


def layer_and_rope(cfg, seq, seed=0):
    torch.manual_seed(seed)
    attn = MultiHeadLatentAttention(cfg).double()
    for name, p in attn.named_parameters():  # non-trivial norm gains, so a skipped norm would show
        if "norm" in name:
            p.data.uniform_(0.5, 1.5)
    inv_freq, _ = rope_for_config(cfg)
    return attn, rope_cos_sin(torch.arange(seq), inv_freq, dtype=torch.float64)


def paper_equations(attn, x, rope, layout):
    """DeepSeek-V2 eqs. 9–19 one head at a time, with explicit loops, from the layer's weights."""
    m = attn
    d_c, nope, rdim, vdim, H = m.kv_rank, m.nope, m.rope_dim, m.v_dim, m.n_heads
    T = x.shape[1]
    rms = lambda z, g: z / torch.sqrt(z.pow(2).mean(-1, keepdim=True) + 1e-5) * g  # noqa: E731
    w_dkv, w_kr = m.wkv_a.weight[:d_c], m.wkv_a.weight[d_c:]
    c_kv = rms(x @ w_dkv.T, m.kv_norm.weight)  # eq. 9
    k_r = apply_rotary(x @ w_kr.T, *rope, layout)  # eqs. 14–15, one head
    q_src = x if hasattr(m, "wq") else rms(x @ m.wq_a.weight.T, m.q_norm.weight)  # eq. 12
    w_q = (m.wq if hasattr(m, "wq") else m.wq_b).weight.view(H, nope + rdim, -1)
    w_b = m.wkv_b.weight.view(H, nope + vdim, d_c)
    outs = []
    for h in range(H):
        q_c = q_src @ w_q[h, :nope].T  # eq. 13
        q_r = apply_rotary(q_src @ w_q[h, nope:].T, *rope, layout)  # eqs. 14–15
        k_c = c_kv @ w_b[h, :nope].T  # eq. 10
        v_c = c_kv @ w_b[h, nope:].T  # eq. 11
        logits = (q_c @ k_c.transpose(-1, -2) + q_r @ k_r.transpose(-1, -2)) * m.softmax_scale  # eqs. 16–18
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(logits.softmax(-1) @ v_c)
    return torch.cat(outs, dim=-1) @ m.wo.weight.T  # eq. 19


@pytest.mark.parametrize("q_lora_rank", [None, 16])
@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_naive_path_is_the_papers_equations(q_lora_rank, layout):
    cfg = mla_cfg(q_lora_rank, layout=layout)
    attn, rope = layer_and_rope(cfg, 9)
    x = torch.randn(2, 9, 64, dtype=torch.float64)
    # RMSNorm (layers.py) computes in float32 even for float64 input, hence ~1e-7 rather than 1e-15 agreement.
    torch.testing.assert_close(attn(x, rope), paper_equations(attn, x, rope, layout), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("q_lora_rank", [None, 16])
@pytest.mark.parametrize("scaling", [None, dict(kind="yarn", factor=4.0, original_max_seq_len=8)])
def test_absorbed_equals_naive_fp64(q_lora_rank, scaling):
    cfg = mla_cfg(q_lora_rank, scaling)
    attn, rope = layer_and_rope(cfg, 12)
    x = torch.randn(3, 12, 64, dtype=torch.float64)
    naive = attn(x, rope)
    assert naive.abs().max() > 1e-3
    torch.testing.assert_close(attn.forward_absorbed(x, rope), naive, rtol=1e-10, atol=1e-13)
    # Decoding: a prompt of 5 tokens, then one token at a time, attending over the cached latents only.
    cache = LatentKVCache()
    pieces = [attn.forward_absorbed(x[:, :5], (rope[0][:5], rope[1][:5]), cache)]
    for t in range(5, 12):
        pieces.append(attn.forward_absorbed(x[:, t:t + 1], (rope[0][t:t + 1], rope[1][t:t + 1]), cache))
    torch.testing.assert_close(torch.cat(pieces, dim=1), naive, rtol=1e-10, atol=1e-13)
    assert len(cache) == 12 and cache.numel_per_token() == kv_cache_elements_per_token_per_layer(cfg)
    assert cache.c_kv.shape == (3, 12, MLA["kv_lora_rank"]) and cache.k_rope.shape == (3, 12, 8)


def test_absorbed_weight_shapes():
    cfg = mla_cfg(16)
    attn, _ = layer_and_rope(cfg, 4)
    w_q, w_o = attn.absorbed_weights()
    assert w_q.shape == (4, 24, 16) and w_o.shape == (64, 4, 24)


def test_softmax_scale_with_and_without_yarn():
    qk = MLA["qk_nope_head_dim"] + MLA["qk_rope_head_dim"]
    assert MultiHeadLatentAttention(mla_cfg()).softmax_scale == pytest.approx(1 / math.sqrt(qk))
    yarn = MultiHeadLatentAttention(mla_cfg(scaling=dict(kind="yarn", factor=40.0, original_max_seq_len=8)))
    assert yarn.softmax_scale == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(qk))


def test_parameter_names_and_init():
    cfg = mla_cfg(16)
    model = build_model(cfg, seed=0)
    names = {n for n, _ in model.named_parameters() if n.startswith("blocks.0.attn.")}
    assert names == {f"blocks.0.attn.{n}.weight" for n in ("wq_a", "q_norm", "wq_b", "wkv_a", "kv_norm", "wkv_b", "wo")}
    a = model.blocks[0].attn
    assert a.wkv_a.weight.shape == (24 + 8, 64) and a.wkv_b.weight.shape == (4 * (12 + 10), 24)  # [out, in]
    assert a.wo.weight.shape == (64, 4 * 10) and a.wq_b.weight.shape == (4 * 20, 16)
    assert torch.equal(a.kv_norm.weight, torch.ones(24)) and torch.equal(a.q_norm.weight, torch.ones(16))
    assert init_std("blocks.0.attn.wo.weight", cfg) == pytest.approx(cfg.init_std / math.sqrt(2 * cfg.n_layers))
    assert init_std("blocks.0.attn.wkv_b.weight", cfg) == cfg.init_std
    plain = {n for n, _ in build_model(mla_cfg(None)).named_parameters() if n.startswith("blocks.0.attn.")}
    assert "blocks.0.attn.wq.weight" in plain and "blocks.0.attn.q_norm.weight" not in plain


def test_kv_cache_formulas_deepseek_v2_table_1():
    """Table 1: MHA 2·n_h·d_h·l, GQA 2·n_g·d_h·l, MQA 2·d_h·l, MLA (d_c + d_h^R)·l ≈ 9/2·d_h·l (V2 shapes)."""
    v2 = mla_reference_config("deepseek-v2")
    n_h, d_h, n_l = v2.n_heads, v2.mla.qk_nope_head_dim, v2.n_layers
    d_c, d_r = v2.mla.kv_lora_rank, v2.mla.qk_rope_head_dim
    assert (n_h, d_h, n_l, d_c, d_r) == (128, 128, 60, 512, 64)
    assert d_c == 4 * d_h and d_r == d_h // 2  # §2.1.4: d_c = 4·d_h, d_h^R = d_h / 2
    assert kv_cache_elements_per_token(v2) == (d_c + d_r) * n_l == 4.5 * d_h * n_l
    mha = v2.replace(attention="gqa", d_model=n_h * d_h)  # the MHA / GQA / MQA with V2's heads
    assert kv_cache_elements_per_token(mha) == 2 * n_h * d_h * n_l and attention_kind(mha) == "MHA"
    gqa = mha.replace(n_kv_heads=8)
    assert kv_cache_elements_per_token(gqa) == 2 * 8 * d_h * n_l and attention_kind(gqa) == "GQA"
    mqa = mha.replace(n_kv_heads=1)
    assert kv_cache_elements_per_token(mqa) == 2 * d_h * n_l and attention_kind(mqa) == "MQA"
    # "equivalent to GQA with only 2.25 groups"
    assert kv_cache_elements_per_token(v2) / (2 * d_h * n_l) == 2.25
    v3 = mla_reference_config("deepseek-v3")
    assert kv_cache_elements_per_token_per_layer(v3) == 576 and kv_cache_elements_per_token(v3) == 576 * 61
    # bytes: bf16, 128K tokens of context, one sequence, V3: 576·61·131072·2 bytes
    assert kv_cache_bytes(v3, tokens=131072) == 576 * 61 * 131072 * 2
    assert kv_cache_bytes(get_preset("llama2-70b"), tokens=4096, batch=2) == 2 * 8 * 128 * 80 * 4096 * 2 * 2
    assert set(MLA_REFERENCE_CONFIGS) >= {"deepseek-v2", "deepseek-v3"}


@pytest.mark.parametrize("bad", [dict(MLA, kv_lora_rank=65), dict(MLA, q_lora_rank=128), dict(MLA, kv_lora_rank=0),
                                 dict(MLA, qk_rope_head_dim=7), dict(MLA, extra=1)])
def test_bad_mla_config_one_line_error(bad):
    with pytest.raises(ValueError) as err:
        get_preset("tiny", d_model=64, attention="mla", mla=bad)
    assert "\n" not in str(err.value)


def test_tiny_mla_model_trains(one_thread):
    torch.manual_seed(0)
    cfg = mla_cfg(16, n_layers=2, d_ff=128)
    model = build_model(cfg, seed=0)
    motif = torch.randint(0, 256, (20,))
    data = motif.repeat(12)
    starts = torch.randint(0, data.numel() - 33, (8,))
    batch = torch.stack([data[s:s + 33] for s in starts])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        loss = lm_loss(model(batch[:, :32]), batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.blocks[0].attn.parameters())
