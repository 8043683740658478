"""Layouts as JSON rows with their memory per pipeline stage (`--json --all`, `--explain-file`, chapter 12): one
search, then any number of layouts looked up in it or evaluated as given, in one process.

A row is `Candidate.row()` plus `mem_per_stage_gib` (each pipeline rank's bytes, the reserved GiB not included) and,
for a layout that does not fit, `overflow_term`: the largest term of its heaviest stage (params, grads, optimizer,
activations, recompute_transient, loss_transient, gathered), the one to shrink first.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from minidist.hardware import GIB
from minidist.model.config import ModelConfig
from minidist.parallel.layout import Layout
from minidist.plan.cluster import Cluster
from minidist.plan.explain import evaluate, parse_settings
from minidist.plan.rank_memory import MEMORY_TERMS, MemoryEstimate, estimate_memory
from minidist.plan.search import Candidate, Plan
from minidist.plan.stack import CP_KINDS, RECOMPUTES, SCHEDULES

MAX_LAYOUT_LINES = 10_000  # a layout file is a table someone wrote; more lines than this is not one
MAX_LAYOUT_BYTES = 1 << 20


def stage_memory(cfg: ModelConfig, plan: Plan, layout: Layout, seq_len: int, sequences: int,
                 memo: dict) -> list[MemoryEstimate]:
    """Every pipeline rank's bytes for `layout` (the search's own precision and model)."""
    micro_batch = sequences // (layout.dims.dp * layout.options.microbatches)
    return [estimate_memory(cfg, layout, seq_len, micro_batch, plan.precision, s, memo, plan.recipe.mtp_depth)
            for s in range(layout.dims.pp)]


def full_row(cfg: ModelConfig, plan: Plan, candidate: Candidate, seq_len: int, sequences: int,
             memo: dict) -> dict[str, Any]:
    """`candidate.row()` with its memory per stage, the heaviest, and the term that overflowed (if it does not fit)."""
    stages = stage_memory(cfg, plan, candidate.layout, seq_len, sequences, memo)
    heaviest = max(stages, key=lambda e: e.total)
    row = {**candidate.row(), "mem_gib": round(heaviest.total / GIB, 2), "heaviest_stage": heaviest.stage,
           "fits": heaviest.total <= plan.budget, "mem_per_stage_gib": [round(e.total / GIB, 2) for e in stages]}
    if not row["fits"]:
        row["overflow_term"] = max(MEMORY_TERMS, key=lambda t: getattr(heaviest, t))
    return row


def all_rows(cfg: ModelConfig, plan: Plan, seq_len: int, sequences: int, top: int) -> list[dict[str, Any]]:
    """`--json --all`: the `top` fastest layouts that fit, then the `top` fastest that do not, each a full row."""
    memo: dict = {}
    return [full_row(cfg, plan, c, seq_len, sequences, memo) for c in [*plan.feasible[:top], *plan.rejected[:top]]]


def read_layout_file(path: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, settings) of each layout line of `path` (`--explain`'s syntax; blank lines and # comments
    skipped), read as untrusted input: its size and lines capped before any line is parsed."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--explain-file {path[:200]!r} is not a file")
    size = file.stat().st_size
    if size > MAX_LAYOUT_BYTES:
        raise ValueError(f"--explain-file {path} is {size:,} bytes; at most {MAX_LAYOUT_BYTES:,} "
                         f"({MAX_LAYOUT_LINES:,} layouts)")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"--explain-file {path} is not UTF-8 text (byte {e.start})") from None
    if len(lines) > MAX_LAYOUT_LINES:
        raise ValueError(f"--explain-file {path} has {len(lines):,} lines; at most {MAX_LAYOUT_LINES:,} layouts")
    out = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if text:
            try:
                out.append((number, parse_settings(text)))
            except ValueError as e:
                raise ValueError(f"--explain-file {path} line {number}: {e}") from None
    if not out:
        raise ValueError(f"--explain-file {path} holds no layout (one per line, e.g. \"dp=8 tp=8 pp=4\")")
    return out


def _check_given(cfg: ModelConfig, layout: Layout, gpus: int, sequences: int) -> None:
    """ValueError for a layout outside the search that no run could have (names, heads, layers, GPUs, batch)."""
    o, d = layout.options, layout.dims
    names = {"schedule": (o.schedule, (*SCHEDULES, "afab")), "recompute": (layout.recompute, RECOMPUTES),
             "cp_impl": (o.cp_impl, (*CP_KINDS, "ulysses"))}
    for key, (value, allowed) in names.items():
        if value not in allowed:
            raise ValueError(f"{key}={value!r} is unknown; choose one of {allowed}")
    if cfg.n_heads % d.tp or d.pp > cfg.n_layers or min(d.dp, d.tp, d.pp, d.cp, d.ep, o.microbatches) < 1:
        raise ValueError(f"tp={d.tp} must divide the {cfg.n_heads} heads, pp={d.pp} be at most the {cfg.n_layers} "
                         "layers, every degree >= 1")
    if d.dp * d.tp * d.pp * d.cp != gpus:
        raise ValueError(f"dp·tp·pp·cp = {d.dp * d.tp * d.pp * d.cp:,}, not the {gpus:,} GPUs")
    if sequences % (d.dp * o.microbatches):
        raise ValueError(f"dp x micro-batches = {d.dp * o.microbatches} does not divide the {sequences} sequences")


def _given(cfg: ModelConfig, plan: Plan, settings: dict[str, Any], gpus: int, seq_len: int, sequences: int,
           cluster: Cluster, memo: dict) -> Candidate:
    """A layout the search did not try, evaluated as given (settings not named at `Layout.of`'s defaults)."""
    layout = Layout.of(**settings)
    _check_given(cfg, layout, gpus, sequences)
    return Candidate(layout, *evaluate(cfg, layout, seq_len, sequences, cluster, plan.precision, plan.recipe,
                                       memo=memo))


def explain_rows(cfg: ModelConfig, plan: Plan, layouts: list[tuple[int, dict[str, Any]]], gpus: int, seq_len: int,
                 sequences: int, cluster: Cluster) -> list[dict[str, Any]]:
    """One row per layout: the fastest of the search with its settings (fitting first; its place among those that
    fit as `rank`), else the layout evaluated as given (unranked). A layout no run could have is refused in one
    line that names its line."""
    memo: dict = {}
    flats = [(c, c.layout.flat()) for c in [*plan.feasible, *plan.rejected]]
    places = {id(c): i for i, c in enumerate(plan.feasible, 1)}
    rows = []
    for number, settings in layouts:
        found = next((c for c, flat in flats if all(flat[k] == v for k, v in settings.items())), None)
        try:
            found = found or _given(cfg, plan, settings, gpus, seq_len, sequences, cluster, memo)
        except (ValueError, TypeError) as e:
            raise ValueError(f"--explain-file line {number}: {e}") from None
        row = full_row(cfg, plan, found, seq_len, sequences, memo)
        rows.append({"line": number, **row, "rank": places.get(id(found))})
    return rows
