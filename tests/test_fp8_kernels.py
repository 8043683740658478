"""The FP8 GEMM as the hardware runs it (`minidist.model.fp8_gemm`): which kernel each recipe takes on a CPU and on
a GPU with or without torch's block-scaled GEMM; the CPU's emulation (the dequantized fp32 matmul) against the
CPU's `torch._scaled_mm` on the same FP8 values and scales; and selective recomputation keeping one output per FP8
GEMM, in the layer's dtype, never the fp32 partials inside it (measured by tensor accounting)."""

import pytest
import torch
from test_fp8 import CountScaledMM

from minidist.memory import LiveTensorBytes
from minidist.model import build_model, get_preset, lm_loss
from minidist.model.fp8 import E4M3, E5M2, quantize
from minidist.model.fp8_gemm import choose_kernel, run_gemm
from minidist.model.fp8_linear import Fp8Recipe, convert_to_fp8, gemm_kernels, linear
from minidist.train.blocks import apply_recompute


def _operands(a_shape, b_shape, granularities, dtypes=(E4M3, E4M3), block=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(*a_shape, generator=g) * torch.logspace(-1, 1, a_shape[1])  # scales that differ by group
    b = torch.randn(*b_shape, generator=g)
    qa, qb = (quantize(t, d, gran, block) for t, d, gran in zip((a, b), dtypes, granularities))
    return qa.data, qa.scale.reciprocal(), qb.data, qb.scale.reciprocal()


def _gemm(ops, granularities, kernel, block=32, out_dtype=torch.float32):
    a, a_inv, b, b_inv = ops
    return run_gemm(a, a_inv, b, b_inv, *granularities, block, kernel, out_dtype)


@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3", "e5m2_grad"])
def test_tensorwise_emulation_equals_the_cpus_scaled_mm(dtypes):
    """On a CPU the tensorwise GEMM is the fp32 matmul of the dequantized operands; the CPU's own `_scaled_mm` on the
    same FP8 values and scales gives the same result to fp32 reduction order (here: bit for bit)."""
    ops = _operands((48, 96), (80, 96), ("tensor", "tensor"), dtypes)
    emulated = _gemm(ops, ("tensor", "tensor"), "dequantized_mm")
    native = _gemm(ops, ("tensor", "tensor"), "scaled_mm")
    torch.testing.assert_close(emulated, native, rtol=1e-6, atol=1e-6 * float(native.abs().max()))
    assert not torch.equal(emulated, ops[0].float() @ ops[2].float().t()), "the scales were applied"


@pytest.mark.parametrize("b_gran", ["block", "tile"])
def test_blockwise_emulation_equals_the_k_sliced_scaled_mm(b_gran):
    """Blockwise: the dequantized fp32 matmul (the CPU's kernel) against the K-sliced `_scaled_mm` (a GPU's kernel
    where the native block-scaled GEMM is missing): the same values to fp32 reduction order, with a partial last
    block (K = 100, blocks of 32) and both operand pairs the three GEMMs use (1×b tiles with b×b blocks: forward
    and input gradient; tiles with tiles: the weight gradient)."""
    ops = _operands((40, 100), (36, 100), ("tile", b_gran))
    emulated = _gemm(ops, ("tile", b_gran), "dequantized_mm")
    sliced = _gemm(ops, ("tile", b_gran), "sliced_scaled_mm")
    torch.testing.assert_close(emulated, sliced, rtol=1e-5, atol=1e-5 * float(sliced.abs().max()))


def test_rowwise_is_one_scaled_mm_written_in_bf16():
    """Rowwise: one `_scaled_mm` with (M, 1) and (1, N) scales writing bf16 (CUDA's rowwise output), equal bit for
    bit to the dequantized fp32 product rounded once to bf16; the caller's dtype only after that rounding."""
    ops = _operands((48, 96), (80, 96), ("row", "row"))
    got = _gemm(ops, ("row", "row"), "scaled_mm")
    a, a_inv, b, b_inv = ops
    want = ((a.float() * a_inv) @ (b.float() * b_inv).t()).bfloat16().float()
    assert got.dtype == torch.float32 and torch.equal(got, want)


def test_which_kernel_runs_where():
    """CPU: rowwise `_scaled_mm`, the others the dequantized matmul. CUDA: `_scaled_mm` for tensorwise and rowwise;
    blockwise natively only with torch's block-scaled GEMM, blocks of 128 and contractions of whole blocks (the
    128×128 operand's rows too), else K-sliced."""
    cpu = {g: choose_kernel(g, g if g != "tile" else "block", "cpu", 128, 256, 256, native=True)
           for g in ("tensor", "row", "tile")}
    assert cpu == {"tensor": "dequantized_mm", "row": "scaled_mm", "tile": "dequantized_mm"}
    assert choose_kernel("tensor", "tensor", "cuda", 128, 48, 48) == "scaled_mm"
    assert choose_kernel("row", "row", "cuda", 128, 48, 48) == "scaled_mm"
    native = {(b, rows, k, block, have): choose_kernel("tile", b, "cuda", block, rows, k, native=have)
              for b, rows, k, block, have in [("block", 256, 512, 128, True), ("tile", 48, 512, 128, True),
                                              ("block", 256, 512, 128, False), ("block", 256, 512, 64, True),
                                              ("block", 256, 320, 128, True), ("block", 320, 512, 128, True)]}
    assert list(native.values()) == ["scaled_mm_blockwise", "scaled_mm_blockwise"] + ["sliced_scaled_mm"] * 4
    # what run.json records: this CPU-only torch has no native block-scaled GEMM, whatever the device asked for
    assert gemm_kernels(Fp8Recipe("blockwise"), torch.device("cuda")) == dict.fromkeys(
        ("forward", "input gradient", "weight gradient"), "sliced_scaled_mm")
    assert gemm_kernels(Fp8Recipe("tensorwise"), torch.device("cpu"))["weight gradient"] == "dequantized_mm"


def _kept_bytes(recipe: str | None, autocast: bool) -> int:
    """Bytes alive after a selectively recomputed forward of a 2-block model (what the backward will use)."""
    cfg = get_preset("tiny", n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, d_ff=128, max_seq_len=64)
    model = build_model(cfg)
    convert_to_fp8(model, None if recipe is None else Fp8Recipe(recipe, block=16))
    apply_recompute(model, "selective")
    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), LiveTensorBytes() as memory:
        loss = lm_loss(model(tokens), tokens)
    assert loss.requires_grad
    return memory.current


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_selective_recompute_keeps_no_fp32_gemm_partials(recipe):
    """--recompute selective --fp8 keeps what it keeps of a plain linear: one output per GEMM, in the layer's dtype
    (bf16 under autocast), so the bytes alive after the forward equal the plain model's, in fp32 and under bf16
    autocast. Kept fp32 partials would show: blockwise's K/16 per-slice products (4 per linear here), rowwise's
    unscaled fp32 product, tensorwise's fp32 output under bf16 autocast."""
    for autocast in (False, True):
        assert _kept_bytes(recipe, autocast) == _kept_bytes(None, autocast), (recipe, autocast)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "blockwise"])
def test_the_gemm_writes_the_autocast_dtype(recipe):
    """Under bf16 autocast the forward GEMM itself writes bf16 (no fp32 M×N output cast afterwards); the input and
    weight gradients are written in their tensors' dtypes (fp32 here)."""
    seen = []

    class OutDtypes(CountScaledMM):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func is torch.ops.minidist.fp8_gemm.default:
                seen.append((args[8], out.dtype))
            return out

    x, w = torch.randn(32, 64, requires_grad=True), torch.randn(48, 64, requires_grad=True)
    with OutDtypes():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = linear(x, w, None, Fp8Recipe(recipe, block=16))
        y.float().sum().backward()
    assert y.dtype == torch.bfloat16 and x.grad.dtype == w.grad.dtype == torch.float32
    assert seen == [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32), (torch.float32, torch.float32)]
