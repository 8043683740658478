"""Parallelisms as transformations of a built model and a rank grid.

`parallelize` (assembly.py) is the one assembly: it applies tensor (tp/; chapter 08), context (cp/; chapter 10),
expert (ep/; chapter 11), pipeline (pp/; chapter 09) and data parallelism with ZeRO (dp/; chapter 07) in one
documented order and returns a `ParallelModel`, the object a
training loop talks to, for a layout described once (`layout.Layout`: the grid's `ParallelDims`, the
`ParallelOptions` of each dimension, the recomputation). Every parameter records where it lives
(`placement.Placement`), and the one gradient norm of the package (`placement.clip_grad_norm_`) reads it.
docs/ARCHITECTURE.md draws the map.
"""

from minidist.parallel.assembly import ParallelModel, StepLosses, count_targets, parallelize
from minidist.parallel.dp.data_parallel import (
    Bucket,
    DataParallel,
    assign_buckets,
    average_gradients,
    check_batch_split,
    split_batch,
)
from minidist.parallel.dp.timeline import Timeline
from minidist.parallel.dp.zero import ZeroOptimizer
from minidist.parallel.dp.zero_bytes import zero_comm_bytes, zero_memory_bytes
from minidist.parallel.dp.zero_params import default_units
from minidist.parallel.layout import Layout, ParallelOptions
from minidist.parallel.placement import Placement, Split, clip_grad_norm_, grad_norm, placement_of

__all__ = [
    "Layout",
    "ParallelModel",
    "ParallelOptions",
    "Placement",
    "Split",
    "StepLosses",
    "clip_grad_norm_",
    "count_targets",
    "grad_norm",
    "parallelize",
    "placement_of",
    "Bucket",
    "DataParallel",
    "Timeline",
    "ZeroOptimizer",
    "assign_buckets",
    "average_gradients",
    "check_batch_split",
    "default_units",
    "split_batch",
    "zero_comm_bytes",
    "zero_memory_bytes",
]
