"""CUDA's kernel contracts checked on this CPU before any process group (`minidist.train.kernel_contracts`): FP8
needs compute capability >= 8.9 and an FP8 peak; every FP8 GEMM of every linear (forward, input and weight gradient,
at its tp shard, over a rank's tokens per micro-batch) runs on fake CUDA tensors, where torch's meta functions apply
CUDA's rules (K and N multiples of 16, B column-major, the block-scaled GEMM's scale layouts); the experts'
`_grouped_mm` choice agrees with CUDA's rule; FlashAttention's head size is checked by hand; and the trainer's
preflight refuses a shape CUDA would crash on, in one line."""

import pytest
import torch

from minidist.comm.topology import ParallelDims
from minidist.model.config import get_preset
from minidist.model.moe.dispatch import grouped_mm_choice
from minidist.parallel.cp.blockwise import block_kernel
from minidist.train.config import ConfigError, TrainConfig
from minidist.train.kernel_contracts import check_fp8_device, contract_spec, fp8_linear_shapes, run_fake_cuda_check
from minidist.train.preflight import preflight

TINY, MLA = get_preset("tiny"), get_preset("tiny", attention="mla")


def _named(spec: dict, case: str) -> dict:
    return {**spec, "fp8": [{**p, "name": f"{case}/{p['name']}"} for p in spec["fp8"]]}


def _cases() -> dict[str, dict]:
    cases = {}
    for recipe in ("tensorwise", "rowwise", "blockwise"):
        for native in (False, True):  # blockwise: the K-sliced kernel, and torch's block-scaled GEMM (sm90)
            cases[f"tiny {recipe} native={native}"] = contract_spec(TINY, ParallelDims(), recipe, 128, 256, "bf16",
                                                                    native)
    cases["tiny rowwise tp2"] = contract_spec(TINY, ParallelDims(tp=2), "rowwise", 128, 256, "bf16", False)
    cases["mla rowwise"] = contract_spec(MLA, ParallelDims(), "rowwise", 128, 256, "bf16", False)
    cases["tiny rowwise 200 tokens"] = contract_spec(TINY, ParallelDims(), "rowwise", 128, 200, "bf16", False)
    cases["tiny blockwise block 24"] = contract_spec(TINY, ParallelDims(), "blockwise", 24, 240, "bf16", False)
    return cases


@pytest.fixture(scope="module")
def failures() -> dict[str, list[str]]:
    """Every case's broken rules, from one subprocess (the check's own): {case: [line, ...]}, experts by widths."""
    cases = _cases()
    spec = {"dtype": "bf16", "fp8": [p for case, s in cases.items() for p in _named(s, case)["fp8"]],
            "experts": [{"d_model": 64, "d_expert": f, "tokens": 64, **force} for f in (36, 64)
                        for force in ({}, {"force": "bf16"}, {"force": "fp32"})]}
    lines = run_fake_cuda_check(spec)
    assert all("\n" not in line for line in lines)
    found = {case: [line for line in lines if f"{case}/" in line] for case in cases}
    found["experts"] = [line for line in lines if line.startswith("MoE experts")]
    return found


def test_fp8_needs_compute_capability_8_9_and_an_fp8_peak():
    with pytest.raises(ValueError, match=r"compute capability >= 8\.9.*NVIDIA A100-SXM4-80GB is 8\.0"):
        check_fp8_device("NVIDIA A100-SXM4-80GB", (8, 0), None)
    check_fp8_device("NVIDIA H100 80GB HBM3", (9, 0), None)  # a datasheet FP8 peak
    for name, cap in (("NVIDIA H100 PCIe", (9, 0)), ("NVIDIA H100 NVL", (9, 0)), ("NVIDIA H200 NVL", (9, 0)),
                      ("NVIDIA B200", (10, 0))):
        with pytest.raises(ValueError, match="no FP8 datasheet peak.*--peak-flops") as info:
            check_fp8_device(name, cap, None)
        assert "\n" not in str(info.value)
        check_fp8_device(name, cap, 1e15)  # --peak-flops given: MFU has its peak


def test_the_default_shapes_keep_every_rule(failures):
    """The tiny preset's linears (d 128, kv 64, d_ff 384) with 256 tokens per micro-batch: every GEMM of every
    recipe passes CUDA's checks, on one rank and on a tp shard, through either blockwise kernel (whose scales then
    have the exact layouts torch's block-scaled GEMM reads)."""
    for case, lines in failures.items():
        if case.startswith("tiny") and "200 tokens" not in case and "block 24" not in case:
            assert lines == [], (case, lines)


def test_mlas_latent_projection_breaks_the_fp8_rule(failures):
    """MLA's wkv_a writes kv_lora_rank + qk_rope_head_dim = 32 + 8 = 40 features: its forward (N = 40) and input
    gradient (K = 40) GEMMs are refused, its weight gradient (over 256 tokens, out 128) and every other linear not."""
    assert fp8_linear_shapes(MLA, 1)["blocks.*.attn.wkv_a"] == (40, 128)
    lines = failures["mla rowwise"]
    assert len(lines) == 2 and all("wkv_a" in line for line in lines), lines
    assert "forward GEMM" in lines[0] and "divisible by 16" in lines[0]


def test_the_weight_gradient_contracts_over_the_tokens(failures):
    """200 tokens per micro-batch and rank: every forward and input gradient fits, every weight gradient (its
    contraction is the tokens) is refused."""
    lines = failures["tiny rowwise 200 tokens"]
    assert len(lines) == 7 and all("weight gradient GEMM" in line and "=200" in line for line in lines), lines


def test_fp8_block_slices_break_the_rule(failures):
    """--fp8-block 24 (no native kernel for it): each K-slice is a GEMM with a contraction of 24."""
    lines = failures["tiny blockwise block 24"]
    assert lines and all("divisible by 16" in line for line in lines), lines


def test_experts_grouped_mm_choice_matches_cudas_rule(failures):
    """`_grouped_mm` on CUDA takes bf16 rows of whole 16 bytes: d_expert 36 is 72 bytes in bf16 (refused by torch's
    own check when forced), so under bf16 autocast the "auto" backend runs the loop there (its rule judges the
    alignment in bf16, not in the fp32 of the model's tensors: 144 bytes), and grouped GEMMs at d_expert 64; fp32
    operands are refused whatever the width (the CPU kernel's fp32 is not CUDA's)."""
    bf16, f32 = torch.bfloat16, torch.float32
    assert grouped_mm_choice(f32, f32, "cuda", bf16, (64, 36)) is None
    assert grouped_mm_choice(f32, f32, "cuda", bf16, (64, 64)) == bf16
    lines = failures["experts"]
    assert len(lines) == 3, lines  # forced bf16 at 36, forced fp32 at 36 and 64; the rule's own choices pass
    assert sum("d_expert 36, torch.bfloat16" in line and "16 bytes" in line for line in lines) == 1
    assert sum("torch.float32" in line and "BF16" in line for line in lines) == 2


def test_flash_attention_head_size_is_checked_by_hand():
    """torch's fake check of the FlashAttention op accepts head sizes 12 and 264, which the CUDA kernel refuses (a
    multiple of 8, at most 256): context parallelism's block kernel takes the reference there."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(), torch.no_grad():  # no autograd: safe in this process
        for d in (12, 264):
            q = torch.empty(1, 2, 16, d, dtype=torch.bfloat16, device="cuda")
            assert torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, 0.0, True, scale=0.1)[0].shape[-1] == d
    kernels = {d: block_kernel("cuda", torch.bfloat16, d, d, False) for d in (12, 64, 256, 264)}
    assert kernels == {12: "einsum", 64: "flash_cuda", 256: "flash_cuda", 264: "einsum"}


def test_the_trainers_preflight_refuses_a_shape_cuda_would_crash_on(tmp_path):
    """--device cuda --fp8 rowwise with MLA: refused in one line naming the linear, before any process group and
    without a GPU (on a machine without CUDA the device check would only come after)."""
    cfg = TrainConfig(model="tiny", model_overrides={"attention": "mla"}, device="cuda", fp8="rowwise",
                      batch_size=2, seq_len=128, steps=1, out=str(tmp_path / "run"), max_bytes=60_000)
    with pytest.raises(ConfigError) as info:
        preflight(cfg)
    message = str(info.value)
    assert "blocks.*.attn.wkv_a's forward GEMM" in message and "\n" not in message, message
