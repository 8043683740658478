"""A split of a prepared dataset as one token stream over its shard files, read row by row.

`TokenShards` is what `BatchSampler` samples windows from when the data is on disk: `numel()` tokens, and
`windows(offsets, length)`, the rows [offsets[i], offsets[i] + length) of the stream, which may straddle a shard
boundary. Nothing is read at open, and a window reads only its own bytes, with `os.pread` (a positional read: no
shared file offset): a rank's memory holds its micro-batch rows whatever the size of the dataset, and the OS page
cache (shared by the ranks of a machine) serves repeated reads. Why not a memory map: the pages a map touches count
in the process's resident memory, and on the machine this was measured on a fault mapped far more than its page
(the page cache's large folios; MADV_RANDOM did not help): 200 steps of the default batch (16 x 129 tokens) from a
1 GB dataset raised a rank's RSS by 980 MB through a map, by nothing measurable through pread (bench/data.py).
`tokens_read` counts the tokens read (the tests hold the sampler to it).
"""

from __future__ import annotations

import bisect
import itertools
import os
import stat
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch


class ShardChanged(ValueError):
    """A shard no longer holds what it held when the dataset was opened (shortened while a run reads it)."""


class TokenShards:
    """Shards (raw little-endian token files, in order) read as one 1-D token stream."""

    def __init__(self, paths: Sequence[Path], counts: Sequence[int], dtype: np.dtype) -> None:
        if len(paths) != len(counts):
            raise ValueError(f"{len(paths)} shard files but {len(counts)} token counts")
        kept = [(Path(p), int(n)) for p, n in zip(paths, counts) if n > 0]  # an empty shard holds no row
        self.paths = [p for p, _ in kept]
        self.counts = [n for _, n in kept]
        self.dtype = np.dtype(dtype)
        self.ends = list(itertools.accumulate(self.counts))  # Python ints: a scalar bisect is faster than numpy's
        self._fds: dict[int, int] = {}
        self.tokens_read = 0

    def numel(self) -> int:
        return self.ends[-1] if self.ends else 0

    def _fd(self, i: int) -> int:
        if i not in self._fds:
            fd = os.open(self.paths[i], os.O_RDONLY | os.O_NONBLOCK)  # a FIFO would block an open without it
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise ValueError(f"shard {str(self.paths[i])!r} is not a regular file (a FIFO or a device?)")
            self._fds[i] = fd
        return self._fds[i]

    def _pread_into(self, i: int, lo: int, row: np.ndarray) -> None:
        """Tokens [lo, lo + len(row)) of shard i straight into `row` (no intermediate bytes object)."""
        size = self.dtype.itemsize
        got = os.preadv(self._fd(i), [row], lo * size)
        if got != row.nbytes:
            raise ShardChanged(f"shard {str(self.paths[i])!r} ended at byte {lo * size + got:,}, before its "
                             f"{self.counts[i]:,} tokens (shortened since the dataset was opened?)")

    def close(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)
        self._fds = {}

    def __del__(self) -> None:
        self.close()

    def _read_into(self, start: int, row: np.ndarray) -> None:
        """Tokens [start, start + len(row)) of the stream into `row` (this split's dtype), across shard ends."""
        length = len(row)
        if not 0 <= start and start + length <= self.numel():
            raise ValueError(f"tokens [{start}, {start + length}) lie outside the {self.numel():,} of these shards")
        done = 0
        shard = bisect.bisect_right(self.ends, start)
        while done < length:
            first = self.ends[shard - 1] if shard else 0
            lo = start + done - first
            take = min(length - done, self.counts[shard] - lo)
            self._pread_into(shard, lo, row[done : done + take])
            done += take
            shard += 1
        self.tokens_read += length

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream as int64, across shard boundaries."""
        row = np.empty(length, dtype=self.dtype)
        self._read_into(start, row)
        return row.astype(np.int64)

    def windows(self, offsets: torch.Tensor, length: int) -> torch.Tensor:
        """int64 [len(offsets), length]: row i is tokens [offsets[i], offsets[i] + length), on the CPU."""
        rows = np.empty((len(offsets), length), dtype=self.dtype)
        for row, start in zip(rows, offsets.tolist()):
            self._read_into(start, row)
        return torch.from_numpy(rows.astype(np.int64))

    def __len__(self) -> int:
        return self.numel()
