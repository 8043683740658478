"""One description of a parallel layout, shared by the trainer, the planner, the memory model and the debug tools.

A layout is three things, each said once:

* `ParallelDims` (`minidist.comm.topology`): the degrees of the rank grid, dp, tp, pp, cp and ep;
* `ParallelOptions`: how each dimension is applied (sequence parallel, the schedule and its micro-batches, the ZeRO
  stage, the context-parallel attention, ...): `parallelize`'s argument;
* `recompute`: whether each block keeps only its input and recomputes the rest in the backward ("full"), keeps its
  matmul and attention outputs and recomputes the element-wise rest ("selective"), or recomputes nothing.

`Layout.of(dp=2, zero=1, sequence_parallel=True, recompute="full")` builds one from flat settings, the way a
command line or a table of cases states them; `Layout.flat()` gives them back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from minidist.comm.topology import ParallelDims

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class ParallelOptions:
    """How each dimension is applied (the grid's sizes come from the Topology)."""

    sequence_parallel: bool = False
    tp_reduce_fp32: bool = False  # sum tensor-parallel partial sums in fp32 under bf16
    schedule: str = "1f1b"
    microbatches: int = 1
    virtual_stages: int = 1
    zero: int = 0  # ZeRO stage over the dp_cp group
    bucket_bytes: int | None = None  # gradient bucket cap (None: `dp.data_parallel.default_bucket_bytes` per device)
    cp_impl: str = "ring"  # context-parallel attention: ring, allgather or ulysses
    loss_chunk: int = 0  # > 0: head + cross-entropy over chunks of this many tokens (not with tp > 1 or ZeRO-3)


_DIMS = tuple(f.name for f in dataclasses.fields(ParallelDims))
_OPTIONS = tuple(f.name for f in dataclasses.fields(ParallelOptions))
SETTINGS = (*_DIMS, *_OPTIONS, "recompute")  # every flat keyword `Layout.of` takes, in this order


@dataclass(frozen=True, repr=False)
class Layout:
    """A parallel layout: the grid's degrees, how each dimension is applied, and the recomputation."""

    dims: ParallelDims = field(default_factory=ParallelDims)
    options: ParallelOptions = field(default_factory=ParallelOptions)
    recompute: str = "none"  # "none", "selective" (matmul outputs kept) or "full" (each block keeps its input)

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")

    @classmethod
    def of(cls, **flat: Any) -> Layout:
        """A layout from flat settings: ParallelDims' and ParallelOptions' fields and `recompute`; the rest default."""
        unknown = ", ".join(repr(key) for key in flat if key not in SETTINGS)
        if unknown:
            raise ValueError(f"unknown layout setting {unknown}; known: {', '.join(SETTINGS)}")
        return cls(ParallelDims(**{k: v for k, v in flat.items() if k in _DIMS}),
                   ParallelOptions(**{k: v for k, v in flat.items() if k in _OPTIONS}),
                   flat.get("recompute", "none"))

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name, in `SETTINGS` order: `Layout.of(**layout.flat()) == layout`."""
        return {**{k: getattr(self.dims, k) for k in _DIMS}, **{k: getattr(self.options, k) for k in _OPTIONS},
                "recompute": self.recompute}

    def changes(self) -> dict[str, Any]:
        """The flat settings that differ from the defaults, e.g. {"dp": 2, "microbatches": 2}."""
        default = Layout().flat()
        return {key: value for key, value in self.flat().items() if value != default[key]}

    def __repr__(self) -> str:
        return f"Layout.of({', '.join(f'{k}={v!r}' for k, v in self.changes().items())})"

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    @property
    def sp_degree(self) -> int:
        """What sequence parallelism splits the tokens outside the tp regions over: tp when on, else 1."""
        return self.dims.tp if self.options.sequence_parallel and self.dims.tp > 1 else 1

    @property
    def replicas(self) -> dict[str, int]:
        """How many ranks hold a copy of each kind of parameter: dense over dp·cp, experts over edp = dp·cp / ep."""
        dims = self.dims
        return {"dense": dims.dp * dims.cp, "experts": dims.dp * dims.cp // dims.ep}
