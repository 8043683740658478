"""The bug museum: real classes of distributed-training bugs, each switchable for the length of a `with` block.

    with museum.bug("grad_norm_one_stage"):
        ...  # everything built and run here has the bug; on exit the real code is back

Each bug patches the package's real code path (a function or method swapped in place, `unittest.mock.patch`
style) and never changes a default: outside the block the package is what it always is. There is no trainer flag
for any of them. Every exhibit records what it is, where it lives, the layout that shows it, the check that catches
it and the parameters a layer-by-layer diff must point at (`layer`, a regular expression on parameter names): the
catalogue is data (museum.toml, next to this file), each exhibit's patch is code (`PATCHES`).

The bugs are well-known classes, described here in our own words; the course's issue #18 gathered them from public
threads (pytorch#118369, nanotron#115 and #209, Megatron-LM#1736 and #1754). The exhibits are re-creations on this
package's code path, not copies of any project's code.

The checks (`fired(name, record, reference)`) compare a run (`minidist.debug.parity_run`) with the one-process
run: the replica hashes of chapter 13, the data-parallel ledger against its byte count, the gradient norm, and the
layer-by-layer diff of gradients, initial parameters or norm contributions (`minidist.debug.grad_diff`), all
against the tolerance that reduction order alone explains (`minidist.debug.tolerance`).
"""

from __future__ import annotations

import contextlib
import functools
import re
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from minidist.comm.communicator import Handle
from minidist.debug import grad_diff, tolerance
from minidist.parallel import Layout, assembly
from minidist.parallel.dp.data_parallel import AllReduceGrads
from minidist.parallel.placement import Placement, placement_of
from minidist.parallel.pp.pipeline import PipelineRunner
from minidist.parallel.tp import tensor as tensor_parallel


@dataclass(frozen=True)
class Bug:
    name: str
    title: str
    description: str
    lives_in: str  # the module (and function) whose behaviour the exhibit changes
    layout: Layout  # the smallest layout that shows it (parity_run.LAB_SETTINGS: dp, tp, pp, microbatches)
    check: str  # which check catches it: replicas, ledger, grad_norm, grads, params, contributions
    diff: str  # what the localizing diff compares: grads, params or contributions
    layer: str  # regular expression: the parameters that diff must flag (and no others)
    patch: Callable[[], contextlib.AbstractContextManager]


# ---------------------------------------------------------------------------------------------------------------
# The patches: each swaps one piece of the real code path for the duration of the block
# ---------------------------------------------------------------------------------------------------------------


def _never_synced() -> contextlib.AbstractContextManager:
    # The reduction a misused no_sync skips (in torch's DDP: the last micro-batch's forward or backward also run
    # inside no_sync): the buckets keep this replica's own accumulated gradient, no bytes move.
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(AllReduceGrads, "launch", lambda self, bucket: Handle(None, bucket.grad)))
    stack.enter_context(mock.patch.object(AllReduceGrads, "complete", lambda self, bucket, result: None))
    return stack


def _pipeline_without_1_over_m() -> contextlib.AbstractContextManager:
    real = PipelineRunner.step

    @functools.wraps(real)
    def step(self, batches, autocast=contextlib.nullcontext, no_sync=None, *, loss_scale, positions=None, docs=None):
        # each micro-batch's loss normalized by its own share only: m times the gradient of the mean
        return real(self, batches, autocast, no_sync, loss_scale=loss_scale * len(batches), positions=positions,
                    docs=docs)
    return mock.patch.object(PipelineRunner, "step", step)


def _norm_counts_tp_replicas() -> contextlib.AbstractContextManager:
    real = Placement.copies

    def copies(self, groups):  # forgets that every tp rank holds the same norm weight
        return real(self, [g for g in groups if g != "tp"])
    return mock.patch.object(Placement, "copies", copies)


def _norm_over_one_stage() -> contextlib.AbstractContextManager:
    real = assembly.ParallelModel.grad_pieces

    @functools.wraps(real)
    def grad_pieces(self):  # the squares are summed over tp (and dp) but never over the pipeline stages
        pieces, groups = real(self)
        return pieces, {name: comm for name, comm in groups.items() if name != "pp"}
    return mock.patch.object(assembly.ParallelModel, "grad_pieces", grad_pieces)


def _tp_init_per_rank_rng() -> contextlib.AbstractContextManager:
    real = tensor_parallel.apply_tensor_parallel

    @functools.wraps(real)
    def apply(model, cfg, tp_comm, *args, **kwargs):
        model = real(model, cfg, tp_comm, *args, **kwargs)
        # each rank draws its shards from its own generator (seed + rank) instead of slicing the (seed, name) init
        generator = torch.Generator().manual_seed(torch.initial_seed() + tp_comm.rank)
        with torch.no_grad():
            for param in model.parameters():
                if placement_of(param).splits["tp"].dim is not None:
                    std = param.std().item()
                    param.copy_(torch.randn(param.shape, generator=generator, device="cpu") * std)  # CPU generator
        return model
    return mock.patch.object(tensor_parallel, "apply_tensor_parallel", apply)


def _vocab_padded_inconsistently(multiple: int = 320) -> contextlib.AbstractContextManager:
    real = tensor_parallel.apply_tensor_parallel

    @functools.wraps(real)
    def apply(model, cfg, tp_comm, *args, **kwargs):
        table = model.tok_emb.weight.detach().clone()
        model = real(model, cfg, tp_comm, *args, **kwargs)
        # the embedding table padded to a multiple of `multiple` rows before it was cut, the output layer not:
        # rank r's slice starts at r·(padded/p) instead of r·(V/p)
        padded = torch.cat([table, table.new_zeros((-table.shape[0]) % multiple, table.shape[1])])
        rows = model.tok_emb.weight.shape[0]
        start = tp_comm.rank * (padded.shape[0] // tp_comm.size)
        with torch.no_grad():
            model.tok_emb.weight.copy_(padded[start:start + rows])
        return model
    return mock.patch.object(tensor_parallel, "apply_tensor_parallel", apply)


def _sample_mean() -> contextlib.AbstractContextManager:
    real_loss = assembly.lm_loss

    def lm_loss(logits, targets, ignore_index=-100, reduction="mean"):
        loss = real_loss(logits, targets, ignore_index, reduction)
        if reduction != "sum":
            return loss
        counted = (targets != ignore_index).sum().clamp(min=1)
        return loss / counted * targets.numel()  # this micro-batch's mean, weighted by its positions

    def count_targets(batches):  # every position counts: the step's loss is the mean of micro-batch means
        return torch.tensor(float(sum(t.numel() for _, t in batches)), dtype=torch.float64, device=batches[0][1].device)
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(assembly, "lm_loss", lm_loss))
    stack.enter_context(mock.patch.object(assembly, "count_targets", count_targets))
    return stack


# ---------------------------------------------------------------------------------------------------------------
# The catalogue (museum.toml, data) and its patches (code)
# ---------------------------------------------------------------------------------------------------------------

PATCHES: dict[str, Callable[[], contextlib.AbstractContextManager]] = {
    "no_sync_never_synced": _never_synced,
    "pipeline_missing_1_over_m": _pipeline_without_1_over_m,
    "grad_norm_tp_replicas": _norm_counts_tp_replicas,
    "grad_norm_one_stage": _norm_over_one_stage,
    "tp_init_per_rank_rng": _tp_init_per_rank_rng,
    "vocab_padded_inconsistently": _vocab_padded_inconsistently,
    "token_vs_sample_mean": _sample_mean,
}


CATALOGUE = Path(__file__).with_name("museum.toml")


def read_catalogue(path: Path = CATALOGUE) -> dict[str, Bug]:
    """The exhibits of `path` in their order there, each with its patch; a ValueError names a mismatch."""
    entries = tomllib.loads(path.read_text())
    if set(entries) != set(PATCHES):
        raise ValueError(f"{path.name} and PATCHES disagree: {sorted(set(entries) ^ set(PATCHES))}")
    return {name: Bug(name, e["title"], e["description"], e["lives_in"], Layout.of(**e["layout"]), e["check"],
                      e["diff"], e["layer"], PATCHES[name]) for name, e in entries.items()}


BUGS: dict[str, Bug] = read_catalogue()


@contextlib.contextmanager
def bug(name: str) -> Iterator[Bug]:
    """Switch bug `name` on for the block (every process that should have it must enter the block)."""
    if name not in BUGS:
        raise ValueError(f"unknown bug {name!r}; the museum has {', '.join(BUGS)}")
    with BUGS[name].patch():
        yield BUGS[name]


# ---------------------------------------------------------------------------------------------------------------
# The checks, each on a run's record (parity_run.merge) against the one-process run's
# ---------------------------------------------------------------------------------------------------------------


def _diff(kind: str, record: dict, reference: dict, tol: float) -> grad_diff.Report:
    """The layer-by-layer diff of `kind`: grads, params (the initial ones) or contributions (to the grad norm)."""
    if kind == "params":
        return grad_diff.diff(record["params0"], reference["params0"], tol)
    if kind == "contributions":
        return grad_diff.diff_contributions(record["contributions"], reference["grads"], tol)
    return grad_diff.diff(record["grads"], reference["grads"], tol)


def localize(name: str, record: dict, reference: dict, dtype: str = "fp32") -> grad_diff.Report:
    """The layer-by-layer diff the exhibit calls for, at the tolerance of one step."""
    return _diff(BUGS[name].diff, record, reference, tolerance.rel_tol(dtype, steps=1))


def checks(record: dict, reference: dict, layout: Layout, dtype: str = "fp32") -> dict[str, str | None]:
    """Every check on one run: {check: None if it passes, else one line saying what it saw}."""
    tol = tolerance.rel_tol(dtype, steps=1)
    out: dict[str, str | None] = {"replicas": record["replica_error"]}
    dp, want = layout.dims.dp, None
    if record["dp_bytes"] is not None:  # a ring all-reduce sends 2(p-1)/p of the fp32 gradient per rank and step
        want = 2 * (dp - 1) / dp * 4 * record["numel"] * len(record["losses"])
    got_bytes = record["dp_bytes"]
    out["ledger"] = (None if want is None or got_bytes >= want
                     else f"dp all-reduce sent {got_bytes} bytes, the gradient needs >= {want:.0f}")
    norm, ref_norm = record["norms"][0], reference["norms"][0]
    out["grad_norm"] = (None if abs(norm - ref_norm) <= tol * ref_norm
                        else f"grad norm {norm:.6g} vs one process {ref_norm:.6g} (ratio {norm / ref_norm:.4g})")
    for kind in ("grads", "params", "contributions"):
        report = _diff(kind, record, reference, tol)
        out[kind] = None if report.ok else report.summary()
    return out


def expected_layer(name: str, names: list[str]) -> list[str]:
    """The parameters (in model order) the exhibit's diff must flag."""
    return [n for n in names if re.search(BUGS[name].layer, n)]
