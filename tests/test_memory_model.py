"""The memory model (minidist.memory's formulas) against bytes measured on a small model on the CPU."""

import pytest
import torch

from minidist.flops import count_params
from minidist.memory import (
    PeakSavedBytes,
    activation_bytes_per_layer,
    korthikanti_activation_bytes,
    model_state_bytes,
)
from minidist.model import build_model
from minidist.model.config import ModelConfig


def _cfg(n_kv_heads: int) -> ModelConfig:
    return ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, d_ff=160,
                       max_seq_len=64)


def _storage_bytes(tensors) -> int:
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_model_state_bytes_match_one_adamw_step():
    cfg = _cfg(2)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16))
    model(tokens).float().square().mean().backward()
    opt.step()
    params = list(model.parameters())
    predicted = model_state_bytes(count_params(cfg), param_bytes=4, grad_bytes=4, master_bytes=0)
    assert _storage_bytes(params) == predicted["params"]
    assert _storage_bytes(p.grad for p in params) == predicted["grads"]
    moments = [s[k] for s in opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert _storage_bytes(moments) == predicted["optimizer"]
    # What the formula leaves out: one step counter (a 0-d fp32 tensor) per parameter tensor.
    steps = [s["step"] for s in opt.state.values()]
    assert _storage_bytes(steps) == 4 * len(params)
    assert predicted["total"] == 16 * count_params(cfg)
    assert model_state_bytes(10)["total"] == 160  # ZeRO §3.1: 2 + 2 + 12 bytes per parameter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_activation_bytes_per_layer_match_saved_tensors(dtype, n_kv_heads):
    cfg = _cfg(n_kv_heads)
    model = build_model(cfg).to(dtype)
    b, s = 2, 64
    rope = model.rotary(torch.arange(s))
    x = torch.randn(b, s, cfg.d_model, dtype=dtype, requires_grad=True)
    with PeakSavedBytes(exclude=[*model.parameters(), *rope]) as saved:
        model.blocks[0](x, rope)
    predicted = activation_bytes_per_layer(cfg, s, b, dtype_bytes=dtype.itemsize)["total"]
    assert saved.total == predicted


def test_korthikanti_flash_drops_the_quadratic_term():
    s, b, h, a = 2048, 1, 4096, 32
    assert korthikanti_activation_bytes(s, b, h, a) == s * b * h * (34 + 5 * a * s // h)
    assert korthikanti_activation_bytes(s, b, h, a) - korthikanti_activation_bytes(s, b, h, a, flash=True) \
        == 5 * a * s * s * b
