"""Matmul rates by shape, measured on the machine at hand (chapter 12): the blocks' linear layers at the rate their
own shapes run, instead of every GEMM at one efficiency of the peak.

A GEMM's rate depends on its shape: few rows (a context-parallel chunk, an expert's share of the tokens) or a
narrow tensor-parallel shard fill fewer of the chip's tiles and waves than the best shape does. No public table
covers a large model's shapes (OpenXLA's H100 table stops at 4,096 in m, n and k); this module measures one, and
the planner reads it:

* `model_gemm_grid(cfg, tps, rows)`: the (m, k, n) the planner can ask for a model: each linear of a block (its
  tensor-parallel shard for every degree in `tps`) for every row count in `rows`, as the forward (m, k, n), the
  input gradient (m, n, k) and the weight gradient (k, m, n) run it;
* `measure_gemm_table(shapes, device, dtype)`: each shape's best rate (`flops.measure_matmul_peak` on one shape),
  with progress; `python -m minidist.plan --model M --measure-gemms FILE` writes the table as JSON;
* `load_gemm_table(path)`: a table read as untrusted input (a regular file, bounded, JSON, every field checked);
* `GemmTable.rate(m, k, n, rows_axis)`: a shape's rate, interpolated in log2 of its row count between measured
  ones (the other two sizes must match); None outside what was measured;
* `linear_rate(table, gemms, fallback)`: the rate of a layout's linears, their FLOP-weighted harmonic mean, each
  shape not in the table at `fallback` (the cluster's efficiency), and how many were not: the report says so.

`layer_gemms` lists a rank's forward GEMMs per micro-batch for the stage's dense and MoE layers, the shapes of
`minidist.model` under `parallel.tp`: GQA's or MLA's projections (MLA's down-projections replicated on every tp
rank), the SwiGLU or GELU MLP split by columns and rows; an MoE layer whole on every tp rank: its router, its
routed experts (ep's share, `rows_per_expert` rows each) and its shared experts.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minidist.flops import measure_matmul_peak
from minidist.model.config import ModelConfig
from minidist.parallel.cp.core import kv_heads_per_rank

FORMAT = "minidist-gemm/1"
MAX_TABLE_BYTES = 16 * 2**20  # a table of every shape of a large model is well under 1 MB
MAX_ROWS = 200_000
MAX_SIZE = 2**24  # the largest m, k or n a row may name
MAX_RATE = 1e17  # FLOP/s: above any chip's peak
MEASURE_ROWS = tuple(2**i for i in range(7, 16))  # 128 to 32,768 rows: a ring's chunk to a micro-batch of 4 x 8k

Shape = tuple[int, int, int]


@dataclass(frozen=True)
class GemmTable:
    """Measured FLOP/s by (m, k, n) (a GEMM of an m×k by a k×n matrix), on `device`, in `dtype`."""

    device: str
    dtype: str
    rates: dict[Shape, float]
    source: str = "measured here"
    _axes: dict = field(init=False, compare=False, repr=False)  # (axis, other two sizes) -> [(rows, rate)], sorted

    def __post_init__(self) -> None:
        axes: dict = {}
        for (m, k, n), rate in self.rates.items():  # along each axis a row count can take: m, or k (weight grads)
            axes.setdefault((0, k, n), []).append((m, rate))
            axes.setdefault((1, m, n), []).append((k, rate))
        object.__setattr__(self, "_axes", {key: sorted(points) for key, points in axes.items()})

    def rate(self, m: int, k: int, n: int, rows_axis: int = 0) -> float | None:
        """FLOP/s of (m, k, n): measured, or interpolated in log2 of the row count (m, or k for `rows_axis` 1)
        between the nearest measured row counts of the same other two sizes; None outside them."""
        rows, key = (m, (0, k, n)) if rows_axis == 0 else (k, (1, m, n))
        points = self._axes.get(key, [])
        if not points or not points[0][0] <= rows <= points[-1][0]:
            return None
        for (lo, lo_rate), (hi, hi_rate) in zip(points, points[1:], strict=False):
            if lo <= rows <= hi:
                t = 0.0 if hi == lo else (math.log2(rows) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
                return lo_rate + t * (hi_rate - lo_rate)
        return points[0][1]  # a single measured row count, equal to `rows`

    def to_json(self) -> str:
        rows = [[m, k, n, rate] for (m, k, n), rate in sorted(self.rates.items())]
        return json.dumps({"format": FORMAT, "device": self.device, "dtype": self.dtype, "rows": rows}) + "\n"


def layer_gemms(cfg: ModelConfig, tp: int, tokens: int, rows_per_expert: float, ep: int = 1
                ) -> dict[str, list[tuple[Shape, float]]]:
    """{"dense": [...], "moe": [...]}: ((m, k, n), count) of one layer's forward GEMMs on one tp rank for one
    micro-batch of `tokens` rows (the module docstring)."""
    d = cfg.d_model
    attention = _attention_gemms(cfg, tp, tokens)
    ff = cfg.d_ff // tp
    mlp = [((tokens, d, ff), 2.0), ((tokens, ff, d), 1.0)] if cfg.mlp == "swiglu" else \
        [((tokens, d, ff), 1.0), ((tokens, ff, d), 1.0)]
    out = {"dense": attention + mlp, "moe": []}
    m = cfg.moe
    if m.n_experts:
        de, rows = m.d_expert or cfg.d_ff, max(1, round(rows_per_expert))
        local = m.n_experts / ep
        moe = [((tokens, d, m.n_experts), 1.0), ((rows, d, de), 2 * local), ((rows, de, d), local)]
        if m.n_shared_experts:
            shared = m.n_shared_experts * de
            moe += [((tokens, d, shared), 2.0), ((tokens, shared, d), 1.0)]
        out["moe"] = attention + moe
    return out


def _attention_gemms(cfg: ModelConfig, tp: int, tokens: int) -> list[tuple[Shape, float]]:
    """The attention projections' forward GEMMs on one tp rank (GQA, or MLA with its replicated down-projections)."""
    d, h = cfg.d_model, cfg.n_heads // tp
    if cfg.attention != "mla":
        kv = kv_heads_per_rank(cfg, tp) * cfg.head_dim
        return [((tokens, d, h * cfg.head_dim), 1.0), ((tokens, d, kv), 2.0), ((tokens, h * cfg.head_dim, d), 1.0)]
    a = cfg.mla
    qk = a.qk_nope_head_dim + a.qk_rope_head_dim
    q = [((tokens, d, h * qk), 1.0)] if a.q_lora_rank is None else \
        [((tokens, d, a.q_lora_rank), 1.0), ((tokens, a.q_lora_rank, h * qk), 1.0)]
    return q + [((tokens, d, a.kv_lora_rank + a.qk_rope_head_dim), 1.0),
                ((tokens, a.kv_lora_rank, h * (a.qk_nope_head_dim + a.v_head_dim)), 1.0),
                ((tokens, h * a.v_head_dim, d), 1.0)]


def training_gemms(forward: Iterable[tuple[Shape, float]], forwards: int = 1) -> list[tuple[Shape, int, float]]:
    """((m, k, n), rows axis, count) of the forward GEMMs (`forwards` times: 2 under full recomputation), each
    one's input gradient (m, n, k) and weight gradient (k, m, n): its rows, the tokens, are the reduction."""
    out = []
    for (m, k, n), count in forward:
        out += [((m, k, n), 0, count * forwards), ((m, n, k), 0, count), ((k, m, n), 1, count)]
    return out


def linear_rate(table: GemmTable, gemms: Sequence[tuple[Shape, int, float]], fallback: float) -> tuple[float, int]:
    """(FLOP/s of all of `gemms` together, the number of distinct shapes the table does not cover): each GEMM at
    its measured rate, or at `fallback`; the FLOP-weighted harmonic mean, so that FLOPs / it = their seconds."""
    flops = seconds = 0.0
    missing = set()
    for (m, k, n), axis, count in gemms:
        rate = table.rate(m, k, n, axis)
        if rate is None:
            missing.add((m, k, n))
        work = 2.0 * m * k * n * count
        flops, seconds = flops + work, seconds + work / (rate or fallback)
    return (flops / seconds if seconds else fallback), len(missing)


def model_gemm_grid(cfg: ModelConfig, tps: Sequence[int], rows: Sequence[int]) -> list[Shape]:
    """Every (m, k, n) the planner can ask of `cfg` for tp degrees `tps` and row counts `rows` (tokens of a
    micro-batch, and rows per expert; ep changes how many GEMMs, not their shapes), forward and backward, sorted."""
    shapes = set()
    for tp in tps:
        for r in rows:
            for gemms in layer_gemms(cfg, tp, r, r).values():
                shapes.update(shape for shape, _, _ in training_gemms(gemms))
    return sorted(shapes)


def measure_gemm_table(shapes: Sequence[Shape], device: str | torch.device, dtype: torch.dtype,
                       seconds_per_shape: float = 0.05, progress: Callable[[str], None] | None = print) -> GemmTable:
    """Each shape's best FLOP/s on `device` in `dtype` (`flops.measure_matmul_peak`), a line of progress every
    tenth of the shapes."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{device.type} ({os.cpu_count()} cores)"
    rates, step = {}, max(1, len(shapes) // 10)
    for i, shape in enumerate(shapes, 1):
        rates[tuple(shape)] = measure_matmul_peak([tuple(shape)], dtype, device, seconds_per_shape)[0]
        if progress is not None and (i % step == 0 or i == len(shapes)):
            progress(f"measured {i} of {len(shapes)} GEMM shapes")
    return GemmTable(name, str(dtype).removeprefix("torch."), rates)


def load_gemm_table(path: str | os.PathLike) -> GemmTable:
    """A table `measure_gemm_table` wrote, read as untrusted input: one-line ValueError for anything else."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--gemm-table {path}: not a regular file")
    with open(path, "rb") as f:
        data = f.read(MAX_TABLE_BYTES + 1)
    if len(data) > MAX_TABLE_BYTES:
        raise ValueError(f"--gemm-table {path}: over the {MAX_TABLE_BYTES:,} bytes a table can be")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"--gemm-table {path}: not JSON ({type(e).__name__})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"--gemm-table {path}: not a {FORMAT} table (write one with --measure-gemms)")
    words = [doc.get(key) for key in ("device", "dtype")]
    if not all(isinstance(w, str) and 0 < len(w) <= 200 for w in words):
        raise ValueError(f"--gemm-table {path}: device and dtype must be names of at most 200 characters")
    rows = doc.get("rows")
    if not isinstance(rows, list) or not 0 < len(rows) <= MAX_ROWS:
        raise ValueError(f"--gemm-table {path}: rows must be a list of 1 to {MAX_ROWS:,} [m, k, n, FLOP/s]")
    return GemmTable(words[0], words[1], _checked_rows(rows, path), source=str(path))


def _checked_rows(rows: list, path: Path) -> dict[Shape, float]:
    """{shape: FLOP/s} of a table's rows, each checked (one-line ValueError naming the first bad row)."""
    rates: dict[Shape, float] = {}
    for i, row in enumerate(rows):
        ok = (isinstance(row, list) and len(row) == 4
              and all(type(x) is int and 0 < x <= MAX_SIZE for x in row[:3])
              and type(row[3]) in (int, float) and 0 < row[3] <= MAX_RATE)
        if not ok:
            raise ValueError(f"--gemm-table {path}: row {i} is {str(row)[:80]}, not [m, k, n, FLOP/s] with sizes in "
                             f"[1, {MAX_SIZE}] and a rate in (0, {MAX_RATE:g}]")
        shape = tuple(row[:3])
        if shape in rates:
            raise ValueError(f"--gemm-table {path}: row {i} measures {shape} a second time")
        rates[shape] = float(row[3])
    return rates
