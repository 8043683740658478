"""One FP8 GEMM, a @ bᵀ, as the hardware at hand runs it: which kernel, and the one operator that runs it.

Both operands arrive quantized along their columns (the GEMM's contraction), with their decoding scales (1/s, the
factor that turns an FP8 value back into the number it stands for), in the compact shape of their granularity:
tensor (), row (rows, 1), tile (rows, ⌈K/b⌉) or block (⌈rows/b⌉, ⌈K/b⌉). The kernels (`choose_kernel`):

- "scaled_mm": `torch._scaled_mm`, one call. Tensorwise with scalar scales, written in the caller's dtype;
  rowwise with (M, 1) and (1, N) fp32 scales, written in bf16 (the only output CUDA's rowwise kernels all take).
  The CPU kernel takes rowwise scales too (its rowwise result equals the dequantized fp32 matmul bit for bit).
- "scaled_mm_blockwise": torch's native block-scaled GEMM (`F.scaled_mm` with `ScalingType.BlockWise1x128` and
  `BlockWise128x128`, the recipe of DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.3.2): only on sm90 with
  cuBLAS >= 12.9, only for blocks of 128 and contractions of whole blocks. Scales are fp32 in the layouts the
  kernel reads: a 1x128 scale (rows, K/128) column-major; a 128x128 one as (K/128 padded to a multiple of 4,
  N/128), column-major. Output bf16.
- "sliced_scaled_mm": where that call is missing (another GPU, an older CUDA, another block size), the contraction
  walked one block at a time, each slice a tensorwise `_scaled_mm` with fp32 output, the partial products scaled
  per row and summed in fp32: the promotion of partial sums DeepSeek-V3 makes every 128 elements.
- "dequantized_mm": on a CPU, tensorwise and blockwise run as the fp32 matmul of the dequantized operands: the same
  FP8 values and scales, fp32 accumulation (equal to the CPU's `_scaled_mm` to fp32 reduction order, tested), at
  the speed of an fp32 matmul (the CPU's tensorwise `_scaled_mm` is a reference kernel ~2,500x slower).

Whatever the kernel, the GEMM is one operator (`minidist::fp8_gemm`), so a selective-recompute policy that keeps
matmul outputs keeps this one output, in the dtype the layer returns, never the fp32 partials inside it; its fake
(shape) function is the implementation itself, so under `FakeTensorMode` it enforces the chosen kernel's rules.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KERNELS = ("scaled_mm", "scaled_mm_blockwise", "sliced_scaled_mm", "dequantized_mm")
NATIVE_BLOCK = 128  # the one block size of torch's block-scaled GEMM


def native_blockwise(device: torch.device) -> bool:
    """Whether this torch and `device` have the native 1x128/128x128 block-scaled GEMM: `F.scaled_mm`, a CUDA >= 12.9
    build, and a compute capability 9.x GPU (torch refuses it elsewhere)."""
    if device.type != "cuda" or not hasattr(F, "scaled_mm") or not torch.version.cuda:
        return False
    cuda = tuple(int(p) for p in torch.version.cuda.split(".")[:2])
    return cuda >= (12, 9) and torch.cuda.get_device_capability(device)[0] == 9


def choose_kernel(a_granularity: str, b_granularity: str, device_type: str, block: int, rows_b: int,
                  contraction: int, native: bool = False) -> str:
    """The kernel of one GEMM (module docstring). `native`: the device has the native block-scaled GEMM."""
    if a_granularity == "row":
        return "scaled_mm"
    if device_type != "cuda":
        return "dequantized_mm"
    if a_granularity == "tensor":
        return "scaled_mm"
    whole = contraction % NATIVE_BLOCK == 0 and (b_granularity != "block" or rows_b % NATIVE_BLOCK == 0)
    return "scaled_mm_blockwise" if native and block == NATIVE_BLOCK and whole else "sliced_scaled_mm"


def row_major(t: torch.Tensor) -> torch.Tensor:
    # clone, not .contiguous(): the same copy, and one that fake CUDA tensors on a CPU-only build also take
    return t if t.is_contiguous() else t.clone(memory_format=torch.contiguous_format)


def _column_major(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor with strides (1, rows): the layout the block-scaled GEMM reads its scales in."""
    return row_major(t.t()).t()


def _per_row_chunks(inv: torch.Tensor, granularity: str, block: int, rows: int) -> torch.Tensor:
    """(rows, ⌈K/b⌉) decoding scales: a tile's as they are, a block's repeated over its rows."""
    return inv if granularity == "tile" else inv.repeat_interleave(block, dim=0).narrow(0, 0, rows)


def _expand(inv: torch.Tensor, granularity: str, block: int, shape: torch.Size) -> torch.Tensor:
    if granularity in ("tensor", "row"):
        return inv
    rows = 1 if granularity == "tile" else block
    return inv.repeat_interleave(rows, dim=0).repeat_interleave(block, dim=1).narrow(0, 0, shape[0]).narrow(
        1, 0, shape[1])


def _fp8_values(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The fp32 value of each of the 256 codes of an FP8 dtype (built per call, never cached: a call under
    FakeTensorMode, e.g. while torch.compile traces, must not leave a fake table for the eager ones)."""
    return torch.arange(256, dtype=torch.int32, device=device).to(torch.uint8).view(dtype).float()


def _dequantized(t: torch.Tensor, inv: torch.Tensor, granularity: str, block: int) -> torch.Tensor:
    """An FP8 operand's fp32 values times its decoding scales. On a CPU each code is looked up in a 256-entry
    table (exact, and ~3x faster than the CPU's element-wise e4m3 cast, measured), a scalar scale folded into
    the table (the same fp32 products, 256 of them instead of one per element)."""
    if t.device.type != "cpu":
        return t.float() * _expand(inv, granularity, block, t.shape)
    table = _fp8_values(t.dtype, t.device)
    codes = t.view(torch.uint8).long()
    if granularity == "tensor":
        return torch.take(table * inv, codes)
    return torch.take(table, codes) * _expand(inv, granularity, block, t.shape)


def _blockwise(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, b_granularity: str
               ) -> torch.Tensor:
    """torch's native 1x128 x (128x128 | 1x128) GEMM, bf16 out; scales laid out as the kernel reads them."""
    if b_granularity == "block":  # (N/128, K/128) -> (K/128 padded to a multiple of 4, N/128), column-major
        b_inv = F.pad(b_inv, (0, -b_inv.shape[1] % 4)).t()
    recipe = {"tile": F.ScalingType.BlockWise1x128, "block": F.ScalingType.BlockWise128x128}
    return F.scaled_mm(a, b.t(), _column_major(a_inv), F.ScalingType.BlockWise1x128, _column_major(b_inv),
                       recipe[b_granularity], output_dtype=torch.bfloat16)


def _sliced(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, a_gran: str, b_gran: str,
            block: int) -> torch.Tensor:
    """The contraction one block at a time: a tensorwise `_scaled_mm` per slice, partials scaled and summed in fp32."""
    inv_a = _per_row_chunks(a_inv, a_gran, block, a.shape[0])
    inv_b = _per_row_chunks(b_inv, b_gran, block, b.shape[0])
    one = torch.ones((), device=a.device)
    out = None
    for c in range(inv_a.shape[1]):  # narrow, not [:, a:b]: fake CUDA tensors (the contract check) take it
        width = min(block, a.shape[1] - c * block)
        part = torch._scaled_mm(row_major(a.narrow(1, c * block, width)), row_major(b.narrow(1, c * block, width)).t(),
                                scale_a=one, scale_b=one, out_dtype=torch.float32)
        part = part * inv_a.narrow(1, c, 1) * inv_b.narrow(1, c, 1).t()
        out = part if out is None else out + part
    return out


def run_gemm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, a_gran: str, b_gran: str,
             block: int, kernel: str, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ bᵀ by `kernel`, in `out_dtype`: a (M, K) and b (N, K) row-major FP8, decoding scales a_inv and b_inv in
    the compact shapes of granularities `a_gran` and `b_gran`."""
    if kernel == "scaled_mm":
        if a_gran == "tensor":
            return torch._scaled_mm(a, b.t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)
        out = torch._scaled_mm(a, b.t(), scale_a=a_inv, scale_b=b_inv.reshape(1, -1), out_dtype=torch.bfloat16)
    elif kernel == "scaled_mm_blockwise":
        out = _blockwise(a, a_inv, b, b_inv, b_gran)
    elif kernel == "sliced_scaled_mm":
        out = _sliced(a, a_inv, b, b_inv, a_gran, b_gran, block)
    elif kernel == "dequantized_mm":
        out = _dequantized(a, a_inv, a_gran, block) @ _dequantized(b, b_inv, b_gran, block).t()
    else:
        raise ValueError(f"fp8 GEMM kernel {kernel!r} is unknown; choose one of {KERNELS}")
    return out.to(out_dtype)


@torch.library.custom_op("minidist::fp8_gemm", mutates_args=())
def fp8_gemm(a: torch.Tensor, a_inv: torch.Tensor, b: torch.Tensor, b_inv: torch.Tensor, a_gran: str, b_gran: str,
             block: int, kernel: str, out_dtype: torch.dtype) -> torch.Tensor:
    """`run_gemm` as one operator (what a recompute policy or a dispatch mode sees of an FP8 GEMM)."""
    return run_gemm(a, a_inv, b, b_inv, a_gran, b_gran, block, kernel, out_dtype)


fp8_gemm.register_fake(run_gemm)
