"""A split of a prepared dataset as one token stream over memory-mapped shard files.

`TokenShards` is what `BatchSampler` samples windows from when the data is on disk: `numel()` tokens, and
`windows(offsets, length)`, the rows [offsets[i], offsets[i] + length) of the stream, which may straddle a shard
boundary. Nothing is read at open: each shard is mapped (np.memmap) the first time a window touches it, and a window
copies only its own tokens, so a rank's memory holds its micro-batch rows and the pages the OS caches, whatever the
size of the dataset. `tokens_read` counts the tokens copied out of the maps (the tests hold the sampler to it).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch


class TokenShards:
    """Shards (raw little-endian token files, in order) read as one 1-D token stream."""

    def __init__(self, paths: Sequence[Path], counts: Sequence[int], dtype: np.dtype) -> None:
        if len(paths) != len(counts):
            raise ValueError(f"{len(paths)} shard files but {len(counts)} token counts")
        kept = [(Path(p), int(n)) for p, n in zip(paths, counts) if n > 0]  # an empty file cannot be mapped
        self.paths = [p for p, _ in kept]
        self.counts = [n for _, n in kept]
        self.dtype = np.dtype(dtype)
        self.ends = np.cumsum(self.counts, dtype=np.int64) if kept else np.zeros(0, dtype=np.int64)
        self._maps: dict[int, np.memmap] = {}
        self.tokens_read = 0

    def numel(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def _shard(self, i: int) -> np.memmap:
        if i not in self._maps:
            self._maps[i] = np.memmap(self.paths[i], dtype=self.dtype, mode="r", shape=(self.counts[i],))
        return self._maps[i]

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
            out[done : done + take] = self._shard(shard)[lo : lo + take]
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
