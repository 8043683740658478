"""Memory that scales: one tensor-parallel rank's shard built on the meta device and materialized one parameter at a
time holds 1/tp of the sharded parameters plus at most one full parameter in transit, never the whole model, and
its values are the slices of the one-process model's (the (seed, name) law)."""

import pytest
import torch

from minidist.flops import count_params
from minidist.memory import LiveTensorBytes
from minidist.model import Transformer, build_model, get_preset
from minidist.model.init import init_value
from minidist.parallel.materialize import ConstructionComm, materialize, meta_model
from minidist.parallel.placement import narrow, placement_of
from minidist.parallel.tp.tensor import apply_tensor_parallel


def _full_bytes(param: torch.Tensor) -> int:
    return torch.Size(placement_of(param).full_shape).numel() * param.element_size()


def build_tp_shard(cfg, seed: int, tp_rank: int, tp_size: int):
    """What the trainer does for one tp rank: the structure on the meta device, the tp swap, then only the kept
    parameters filled from (seed, name)."""
    model = meta_model(cfg)
    apply_tensor_parallel(model, cfg, ConstructionComm(tp_rank, tp_size))
    return materialize(model, cfg, seed, "cpu")


def test_llama3_8b_tp8_shard_is_an_eighth_and_needs_no_process_group():
    cfg = get_preset("llama3-8b")
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_tensor_parallel(model, cfg, ConstructionComm(5, 8))  # raises if construction tried to communicate
    local = sum(p.numel() for p in model.parameters())
    replicated = sum(p.numel() for p in model.parameters()
                     if all(split.dim is None for split in placement_of(p).splits.values()))
    assert replicated == (2 * cfg.n_layers + 1) * cfg.d_model  # the norm gains; everything else is sharded
    assert local == (count_params(cfg) - replicated) // 8 + replicated  # 1.004B of 8.03B
    with pytest.raises(RuntimeError, match="does not communicate"):
        ConstructionComm(0, 8).all_reduce(torch.zeros(1))


def test_materializing_a_shard_holds_the_shard_plus_one_full_parameter():
    # llama3-8b's layer shapes (d 4096, d_ff 14336, GQA 32/8), one block and a 16k vocabulary to keep the test fast.
    cfg = get_preset("llama3-8b", n_layers=1, vocab_size=16384)
    with LiveTensorBytes() as memory:
        model = build_tp_shard(cfg, seed=0, tp_rank=3, tp_size=8)
    shard = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    largest = max(_full_bytes(p) for p in model.parameters())
    full_model = count_params(cfg) * 4
    assert memory.current == shard + buffers  # what stays: this rank's parameters (and RoPE's frequencies)
    assert memory.peak <= shard + buffers + largest  # plus at most one full parameter in transit
    assert memory.peak < full_model / 3  # never the model: the full model would be 8x the shard
    # The values are slices of the (seed, name) law, whatever tp is.
    for name in ("tok_emb.weight", "blocks.0.attn.wk.weight", "blocks.0.mlp.w2.weight"):
        param = model.get_parameter(name)
        full = init_value(name, placement_of(param).full_shape, cfg, seed=0)
        assert torch.equal(param, narrow(full, placement_of(param).splits["tp"]))


@pytest.mark.parametrize("rank", [0, 1])
def test_shard_equals_sharding_the_built_model(rank):
    cfg = get_preset("tiny", n_layers=2)
    reference = apply_tensor_parallel(build_model(cfg, seed=3), cfg, ConstructionComm(rank, 2))
    shard = build_tp_shard(cfg, seed=3, tp_rank=rank, tp_size=2)
    assert [n for n, _ in shard.named_parameters()] == [n for n, _ in reference.named_parameters()]
    for (name, a), b in zip(reference.named_parameters(), shard.parameters()):
        assert torch.equal(a, b), name
        assert placement_of(a) == placement_of(b)
    for (name, a), b in zip(reference.named_buffers(), shard.buffers()):
        assert torch.equal(a, b), name


_TINY = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=32)
_VARIANTS = {
    "llama": {},
    "gpt": dict(mlp="gelu", norm="layernorm", bias=True, position="learned", tie_embeddings=True),
    "mla-moe": dict(attention="mla", moe=dict(n_experts=4, top_k=2, n_shared_experts=1, first_dense_layers=1)),
    "yarn": dict(rope_scaling=dict(kind="yarn", factor=4.0, original_max_seq_len=8)),
}


@pytest.mark.parametrize("variant", sorted(_VARIANTS))
def test_meta_model_materialized_equals_build_model(variant):
    # What the trainer builds on one process: the structure on meta, then every parameter and buffer filled.
    cfg = get_preset("tiny", **_TINY, **_VARIANTS[variant])
    reference = build_model(cfg, seed=5)
    model = materialize(meta_model(cfg), cfg, seed=5)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in reference.named_parameters()]
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(a, b), name
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in reference.named_buffers()]
    for (name, a), b in zip(reference.named_buffers(), model.buffers()):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    if cfg.tie_embeddings:
        assert model.lm_head.weight is model.tok_emb.weight
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(tokens), reference(tokens))


def test_gradient_hooks_survive_materialization():
    # Tensor parallel registers gradient hooks on meta parameters (replicated kv heads): they must still run.
    cfg = get_preset("tiny", **_TINY)
    model = meta_model(cfg)
    calls = []
    model.blocks[0].attn.wk.weight.register_hook(lambda grad: calls.append(grad.shape) or grad * 2)
    materialize(model, cfg, seed=0)
    weight = model.blocks[0].attn.wk.weight
    (weight * 1).sum().backward()
    assert calls == [weight.shape] and torch.equal(weight.grad, torch.full_like(weight, 2.0))
