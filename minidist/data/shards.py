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

import os
import stat
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch


class TokenShards:
    """Shards (raw little-endian token files, in order) read as one 1-D token stream."""

    def __init__(self, paths: Sequence[Path], counts: Sequence[int], dtype: np.dtype) -> None:
        if len(paths) != len(counts):
            raise ValueError(f"{len(paths)} shard files but {len(counts)} token counts")
        kept = [(Path(p), int(n)) for p, n in zip(paths, counts) if n > 0]  # an empty shard holds no row
        self.paths = [p for p, _ in kept]
        self.counts = [n for _, n in kept]
        self.dtype = np.dtype(dtype)
        self.ends = np.cumsum(self.counts, dtype=np.int64) if kept else np.zeros(0, dtype=np.int64)
        self._fds: dict[int, int] = {}
        self.tokens_read = 0

    def numel(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def _fd(self, i: int) -> int:
        if i not in self._fds:
            fd = os.open(self.paths[i], os.O_RDONLY | os.O_NONBLOCK)  # a FIFO would block an open without it
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise ValueError(f"shard {str(self.paths[i])!r} is not a regular file (a FIFO or a device?)")
            self._fds[i] = fd
        return self._fds[i]

    def _pread(self, i: int, lo: int, n: int) -> np.ndarray:
        size = self.dtype.itemsize
        data = os.pread(self._fd(i), n * size, lo * size)
        if len(data) != n * size:
            raise ValueError(f"shard {str(self.paths[i])!r} ended at byte {lo * size + len(data):,}, before its "
                             f"{self.counts[i]:,} tokens (shortened since the dataset was opened?)")
        return np.frombuffer(data, dtype=self.dtype)

    def close(self) -> None:
        for fd in getattr(self, "_fds", {}).values():
            os.close(fd)
        self._fds = {}

    def __del__(self) -> None:
        self.close()

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of the stream as int64, across shard boundaries."""
        if not 0 <= start and start + length <= self.numel():
            raise ValueError(f"tokens [{start}, {start + length}) lie outside the {self.numel():,} of these shards")
        out = np.empty(length, dtype=np.int64)
        done = 0
        shard = int(np.searchsorted(self.ends, start, side="right"))
        while done < length:
            first = int(self.ends[shard - 1]) if shard else 0
            lo = start + done - first
            take = min(length - done, self.counts[shard] - lo)
            out[done : done + take] = self._pread(shard, lo, take)
            done += take
            shard += 1
        self.tokens_read += length
        return out

    def windows(self, offsets: torch.Tensor, length: int) -> torch.Tensor:
        """int64 [len(offsets), length]: row i is tokens [offsets[i], offsets[i] + length), on the CPU."""
        rows = [self.read(int(o), length) for o in offsets.tolist()]
        if not rows:
            return torch.empty(0, length, dtype=torch.int64, device="cpu")
        return torch.from_numpy(np.stack(rows))

    def __len__(self) -> int:
        return self.numel()
