"""The deterministic, resumable batch sampler, over a token tensor (a text source read into memory) or a token
source on disk (`minidist.data.shards.TokenShards`: the shards of a prepared dataset, read row by row).

A token source is anything with `numel()` and `windows(offsets, length)` (int64 rows [offsets[i], offsets[i] +
length) of its stream): the sampler draws the same offsets from (seed, step) either way, so a dataset gives the
batches its tokens would give as a tensor, and a rank asks the source for its own rows only.
"""

from __future__ import annotations

import hashlib
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class TokenSource(Protocol):
    def numel(self) -> int: ...

    def windows(self, offsets: torch.Tensor, length: int) -> torch.Tensor: ...




def _step_seed(seed: int, step: int) -> int:
    # Hash (seed, step) into a 63-bit generator seed: neighbouring seeds/steps give unrelated streams. The salt is
    # the sampler's first module path: part of every run's data order, so it stays when the module moves.
    digest = hashlib.blake2b(f"minidist.corpus:{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & ((1 << 63) - 1)


class BatchSampler:
    """Deterministic random windows: the global batch of step s depends only on (seed, s).

    Each row is a window of seq_len + 1 tokens starting at a uniform random offset in [0, len - seq_len - 1];
    inputs are its first seq_len tokens and targets its last seq_len (inputs shifted by one). Because any step can be
    produced on its own, resuming is exact (store `step`) and data-parallel ranks take row slices of the same batch.
    """

    def __init__(self, tokens: torch.Tensor | TokenSource, seq_len: int, global_batch: int, seed: int) -> None:
        tensor = isinstance(tokens, torch.Tensor)
        if not (tensor or isinstance(tokens, TokenSource)) or (tensor and tokens.dim() != 1):
            raise ValueError(f"tokens must be a 1-D tensor or a token source (numel, windows), got "
                             f"{getattr(tokens, 'shape', type(tokens).__name__)}")
        if tensor and (tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool):
            raise ValueError(f"tokens must be an integer tensor, got {tokens.dtype}")
        for name, value in (("seq_len", seq_len), ("global_batch", global_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if tokens.numel() < seq_len + 1:
            raise ValueError(
                f"corpus has {tokens.numel():,} tokens, fewer than seq_len + 1 = {seq_len + 1:,} needed for one window"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.step = 0  # the next step next_batch() / __next__ produces
        # Rows are cut on the host (a CPU generator decides the offsets); the trainer moves each batch to its device.
        self._window = torch.arange(seq_len + 1, device="cpu")

    def _offsets(self, step: int) -> torch.Tensor:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        g = torch.Generator().manual_seed(_step_seed(self.seed, step))
        return torch.randint(0, self.tokens.numel() - self.seq_len, (self.global_batch,), generator=g, device="cpu")

    def _rows(self, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(self.tokens, torch.Tensor):
            windows = self.tokens[offsets[:, None] + self._window].long()
        else:  # on disk: the source reads these rows and nothing else
            windows = self.tokens.windows(offsets, self.seq_len + 1)
        return windows[:, :-1], windows[:, 1:]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of the global batch of `step`, both int64 [global_batch, seq_len]."""
        return self._rows(self._offsets(step))

    def shard(self, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [rank*B/world, (rank+1)*B/world) of batch(step), computed without building the others."""
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be an int >= 1, got {world!r}")
        if not isinstance(rank, int) or not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank!r}")
        if self.global_batch % world:
            raise ValueError(
                f"global_batch {self.global_batch} is not divisible by world {world}; use a multiple of {world}"
            )
        per = self.global_batch // world
        return self._rows(self._offsets(step)[rank * per : (rank + 1) * per])

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.step)
        self.step += 1
        return out

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "num_tokens": self.tokens.numel(),
            "step": self.step,
        }

    def load_state_dict(self, state: dict) -> None:
        missing = [k for k in ("seed", "seq_len", "global_batch", "step") if k not in state]
        if missing:
            raise ValueError(f"sampler state lacks {missing}; expected a dict from BatchSampler.state_dict()")
        mine = self.state_dict()
        keys = ["seed", "seq_len", "global_batch"] + (["num_tokens"] if "num_tokens" in state else [])
        diffs = [f"{k} {state[k]} in state vs {mine[k]} here" for k in keys if state[k] != mine[k]]
        if diffs:
            raise ValueError(f"sampler state does not match this sampler: {'; '.join(diffs)}")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"sampler state has step {step!r}; expected an int >= 0")
        self.step = step
