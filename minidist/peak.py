"""The peak FLOP/s that MFU divides by, where it comes from, and an MFU that cannot pass 100%.

* A known GPU: the datasheet's dense bf16 figure (`minidist.flops.PEAK_FLOPS_BF16`, sources there), matched on
  the name CUDA reports.
* A CPU or an unknown GPU: measured. One matmul timed a few times is a poor ceiling (a 1024³ matmul runs ~0.15 s,
  its best shape is not the model's, and a busy machine at start-up measures low, which gave MFU 115% on a CPU).
  `measure_matmul_peak` times several shapes, the model's own among them, for at least `min_seconds` in all, and
  keeps the best rate: on CUDA with CUDA events, on a CPU with the wall clock.
* A measured peak is still a sample. `MfuMeter` raises it to any rate a step achieved (and says so once), so MFU
  stays at most 1, and keeps the cumulative figure: total model FLOPs over total step time.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from minidist.flops import PEAK_FLOPS_BF16
from minidist.model.config import ModelConfig

# The name torch.cuda.get_device_name reports -> PEAK_FLOPS_BF16 key. Checked in this order: the first substring
# found wins, so the more specific names ("H100 NVL", "H100 PCIe") come before the bare "H100" (the SXM part,
# e.g. "NVIDIA H100 80GB HBM3").
DEVICE_NAMES: tuple[tuple[str, str], ...] = (
    ("H200 NVL", "H200-NVL"), ("H200", "H200-SXM"), ("H100 NVL", "H100-NVL"), ("H100 PCIe", "H100-PCIe"),
    ("H100", "H100-SXM"), ("H800", "H800"), ("A100", "A100"), ("B200", "B200"),
)

MFU_CONVENTION = ("model FLOPs per token = 6*N (matmul parameters incl. the output head, not the input "
                  "embedding) + causal attention (T+1)/2 unmasked pairs per token, fwd+bwd; no recomputation")


def datasheet_chip(device_name: str) -> str | None:
    """The PEAK_FLOPS_BF16 key of a CUDA device name, or None for a chip we have no datasheet figure for."""
    return next((key for part, key in DEVICE_NAMES if part in device_name), None)


def model_matmul_shapes(cfg: ModelConfig, tokens: int) -> list[tuple[int, int, int]]:
    """The (m, k, n) of the model's own forward matmuls for `tokens` tokens: qkv, the feed-forward, the head."""
    d, kv = cfg.d_model, cfg.n_kv_heads * cfg.head_dim
    shapes = [(tokens, d, cfg.n_heads * cfg.head_dim), (tokens, d, kv), (tokens, d, cfg.d_ff),
              (tokens, cfg.d_ff, d), (tokens, d, cfg.vocab_size)]
    return sorted(set(shapes))


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """A function that runs `fn` `n` times and returns the seconds it took on `device`."""
    if device.type == "cuda":
        def run(fn: Callable[[], object], n: int) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3  # ms -> s
        return run

    def run_cpu(fn: Callable[[], object], n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            fn()
        return time.perf_counter() - start
    return run_cpu


def measure_matmul_peak(shapes: list[tuple[int, int, int]], dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu",
                        min_seconds: float = 1.0) -> tuple[float, tuple[int, int, int]]:
    """The best FLOP/s (2·m·k·n per matmul) over `shapes`, each timed in batches for min_seconds/len(shapes) after
    one warm-up batch; returns (FLOP/s, the shape that reached it)."""
    if not shapes or min_seconds <= 0:
        raise ValueError(f"need at least one shape and min_seconds > 0, got {len(shapes)} shapes, {min_seconds}")
    device = torch.device(device)
    timer, budget = _timer(device), min_seconds / len(shapes)
    best, best_shape = 0.0, shapes[0]
    for m, k, n in shapes:
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        fn = functools.partial(torch.mm, a, b)
        reps = 1
        timer(fn, 1)  # warm-up: allocation, kernel selection
        spent = 0.0
        while spent < budget:
            seconds = timer(fn, reps)
            spent += seconds
            if seconds > 0 and 2.0 * m * k * n * reps / seconds > best:
                best, best_shape = 2.0 * m * k * n * reps / seconds, (m, k, n)
            reps = min(reps * 2, 64) if seconds < budget / 8 else reps  # batches long enough to time well
    return best, best_shape


def peak_for_device(device: torch.device, dtype: str, override: float | None, cfg: ModelConfig,
                    tokens: int, min_seconds: float = 1.0) -> tuple[float, str]:
    """Peak FLOP/s of one device for MFU and its source: --peak-flops, the datasheet of a known GPU, else measured
    over square shapes and the model's own matmuls (`tokens` per micro-batch)."""
    if override:
        return override, "set by --peak-flops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        chip = datasheet_chip(name)
        if chip is not None:
            return PEAK_FLOPS_BF16[chip], f"datasheet dense bf16 peak of {chip} ({name}); see minidist/flops.py"
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    shapes = [(s, s, s) for s in (512, 1024, 2048)] + model_matmul_shapes(cfg, tokens)
    peak, (m, k, n) = measure_matmul_peak(shapes, torch_dtype, device, min_seconds)
    return peak, (f"measured {device.type} {dtype} matmul peak: best of {len(shapes)} shapes (squares and the "
                  f"model's own) over >= {min_seconds:g} s, reached at {m}x{k}x{n}")


class MfuMeter:
    """MFU per step and cumulative, against a peak that a step's achieved rate raises (so MFU <= 1 always)."""

    def __init__(self, flops_per_token: float, peak_flops: float) -> None:
        if peak_flops <= 0:
            raise ValueError(f"peak_flops must be > 0, got {peak_flops}")
        self.flops_per_token = flops_per_token
        self.peak = peak_flops  # of the whole job: per-device peak × devices
        self.raised_from: float | None = None
        self.tokens = 0
        self.seconds = 0.0

    def step(self, tokens: int, seconds: float, count: bool = True) -> tuple[float, str | None]:
        """This step's MFU, and a message the first time a step beat the peak (which then becomes the peak).
        count=False leaves the step out of the cumulative figure (the first step pays one-time costs)."""
        achieved = tokens * self.flops_per_token / seconds
        message = None
        if achieved > self.peak:
            if self.raised_from is None:
                message = (f"note: a step reached {achieved / 1e9:,.1f} GFLOP/s, above the peak "
                           f"{self.peak / 1e9:,.1f}; the peak is raised to what was achieved (MFU stays <= 100%)")
                self.raised_from = self.peak
            self.peak = achieved
        if count:
            self.tokens += tokens
            self.seconds += seconds
        return achieved / self.peak, message

    @property
    def cumulative(self) -> float:
        """Total model FLOPs over total counted step time, against the final peak."""
        return self.tokens * self.flops_per_token / (self.seconds * self.peak) if self.seconds else 0.0
