"""Parallelisms as transformations of a built model and a rank grid (DESIGN §2).

Chapter 07, data parallelism: `DataParallel` (bucketed, overlapped gradient all-reduce, accumulation, fp32
reduction) and `ZeroOptimizer` (ZeRO stages 0-3 over the "dp_cp" group of a Topology).
"""

from minidist.parallel.data_parallel import (
    Bucket,
    DataParallel,
    Timeline,
    assign_buckets,
    average_gradients,
    check_batch_split,
    split_batch,
)
from minidist.parallel.zero import ZeroOptimizer, default_units, storage_bytes, zero_comm_bytes, zero_memory_bytes

__all__ = [
    "Bucket",
    "DataParallel",
    "Timeline",
    "ZeroOptimizer",
    "assign_buckets",
    "average_gradients",
    "check_batch_split",
    "default_units",
    "split_batch",
    "storage_bytes",
    "zero_comm_bytes",
    "zero_memory_bytes",
]
