"""Layer by layer: which parameter of a parallel run differs from the one-process run, and by how much.

A loss curve says *that* something is off (and often not even that: clipping and Adam hide a mis-scaled gradient).
Comparing the full gradients by name says *where*. Every parameter gets a relative error

    rel = ||got − want||₂ / ||want||₂

against the reference, and the parameters whose error passes the tolerance (`minidist.debug.tolerance`, the error
reduction order alone makes) are flagged, in model order: the first flagged one is where to start reading, the
largest is the loudest. The ratio ||got|| / ||want|| tells a mis-scaled gradient (one ratio everywhere, e.g. m for
a missing 1/m) from a wrong one.

The same comparison works for parameters (a wrong initial shard) and for what each parameter contributed to the
gradient norm (`norm_contributions`: Σ ||g||² / copies over the ranks, computed the way `placement.grad_norm` computes
it), which localizes a norm that counts a replica twice or forgets a pipeline stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from minidist.comm.communicator import Comm
from minidist.parallel.placement import gather_full


def full_named(model: nn.Module, tp_comm: Comm | None = None, grads: bool = False) -> dict[str, torch.Tensor]:
    """{name: full fp32 tensor} of the parameters (or gradients) this rank holds, gathered over tp when `tp_comm`
    is given (collective over tp). Names are the plain model's."""
    if tp_comm is not None:
        return {name: t.float() for name, t in gather_full(model, tp_comm, "tp", grads).items()}
    pairs = ((name, p.grad if grads else p) for name, p in model.named_parameters())
    return {name: t.detach().float().clone() for name, t in pairs if t is not None}


@torch.no_grad()
def norm_contributions(parallel, names: list[str]) -> dict[str, float]:
    """{name: what that parameter added to the squared gradient norm} as this rank's `ParallelModel` computes the
    norm: its own pieces' Σ ||g||² / copies, summed over the groups `grad_pieces` names (collective over them).
    One vector of len(names) per all-reduce, so every rank must pass the same names (the full model's)."""
    pieces, groups = parallel.grad_pieces()
    owner = {id(p.grad): name for name, p in parallel.model.named_parameters() if p.grad is not None}
    index = {name: i for i, name in enumerate(names)}
    device = pieces[0][0].device if pieces else torch.device("cpu")
    squares = torch.zeros(len(names), dtype=torch.float64, device=device)
    for grad, placement in pieces:
        name = owner.get(id(grad))
        if name is None:
            raise ValueError("norm_contributions needs whole gradients (no ZeRO): a piece has no parameter name")
        squares[index[name]] += grad.double().pow(2).sum() / placement.copies(list(groups))
    for comm in groups.values():
        comm.all_reduce(squares)
    return dict(zip(names, squares.tolist()))


@dataclass(frozen=True)
class Entry:
    name: str
    rel: float  # ||got − want|| / ||want|| (inf: missing, or nonzero where the reference is zero)
    ratio: float  # ||got|| / ||want||


@dataclass
class Report:
    """The diff of one run against the reference: every parameter in model order, and those past `tol`."""

    entries: list[Entry]
    tol: float

    @property
    def flagged(self) -> list[str]:
        return [e.name for e in self.entries if e.rel > self.tol]

    @property
    def first(self) -> str | None:
        flagged = self.flagged
        return flagged[0] if flagged else None

    @property
    def largest(self) -> Entry | None:
        return max(self.entries, key=lambda e: e.rel) if self.flagged else None

    @property
    def ok(self) -> bool:
        return not self.flagged

    def uniform_ratio(self, spread: float = 1e-3) -> float | None:
        """The one ||got||/||want|| every flagged parameter shares (within `spread`), or None: a mis-scaled
        gradient, not a wrong one."""
        ratios = [e.ratio for e in self.entries if e.rel > self.tol and math.isfinite(e.ratio)]
        if len(ratios) < 2 or len(ratios) != len(self.flagged) or max(ratios) - min(ratios) > spread * max(ratios):
            return None
        return sum(ratios) / len(ratios)

    def summary(self) -> str:
        if self.ok:
            return f"all {len(self.entries)} parameters within {self.tol:.1e}"
        flagged, worst = self.flagged, self.largest
        scope = "every parameter" if len(flagged) == len(self.entries) else f"{len(flagged)} of {len(self.entries)}"
        line = (f"{scope} past {self.tol:.1e}; first {self.first}; largest {worst.name} "
                f"(rel {worst.rel:.2e}, ratio {worst.ratio:.4g})")
        ratio = self.uniform_ratio()
        return line + (f"; one ratio everywhere: {ratio:.4g}" if ratio is not None else "")

    def table(self, only_flagged: bool = True) -> str:
        rows = [e for e in self.entries if e.rel > self.tol or not only_flagged]
        width = max([len(e.name) for e in rows] + [9])
        lines = [f"{'parameter':<{width}}  {'rel error':>10}  {'ratio':>8}"]
        lines += [f"{e.name:<{width}}  {e.rel:>10.2e}  {e.ratio:>8.4g}" for e in rows]
        return "\n".join(lines)


def _rel(got: torch.Tensor | None, want: torch.Tensor, floor: float) -> tuple[float, float]:
    """(relative error, norm ratio) of one tensor; the error is relative to max(||want||, floor)."""
    want = want.double()
    ref = want.norm().item()
    if got is None or got.shape != want.shape:
        return math.inf, math.nan
    got = got.double()
    err, size = (got - want).norm().item(), got.norm().item()
    scale = max(ref, floor)
    if scale == 0:
        return (0.0 if err == 0 else math.inf), (1.0 if size == 0 else math.inf)
    return err / scale, (size / ref if ref > 0 else math.inf)


def diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> Report:
    """Compare named tensors (gradients or parameters) with the reference's, in the reference's order.

    A rounding error is relative to the size of the terms that were summed, not of the result: a gradient that
    cancels to almost nothing (a key bias under softmax's shift invariance: ~1e-11) carries the rounding of its
    large terms. So each tensor's error is measured against max(||want||, its share of the whole reference:
    RMS element × sqrt(numel)); tensors of typical size or larger are measured against their own norm."""
    total = sum(t.double().pow(2).sum().item() for t in want.values())
    count = sum(t.numel() for t in want.values())
    rms = math.sqrt(total / count) if count else 0.0
    entries = []
    for name, ref in want.items():
        rel, ratio = _rel(got.get(name), ref, rms * math.sqrt(ref.numel()))
        entries.append(Entry(name, rel, ratio))
    return Report(entries, tol)


def diff_contributions(got: dict[str, float], want_grads: dict[str, torch.Tensor], tol: float) -> Report:
    """Compare norm contributions with the reference's ||g||² per parameter (relative to each)."""
    entries = []
    for name, grad in want_grads.items():
        ref = grad.double().pow(2).sum().item()
        value = got.get(name, 0.0)
        rel = abs(value - ref) / ref if ref > 0 else (0.0 if value == 0 else math.inf)
        entries.append(Entry(name, rel, value / ref if ref > 0 else math.nan))
    return Report(entries, tol)
