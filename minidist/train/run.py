"""The trainer's run record: everything a training loop holds, built once by `minidist.train.loop.setup`.

`minidist.train.loop` advances it step by step; `minidist.train.run_state` checkpoints and restores it. Lower layers
never see it: they take the parts they need (the replica check takes the `ParallelModel`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from minidist.comm.bootstrap import DistEnv
from minidist.comm.topology import Topology
from minidist.data.sampler import BatchSampler
from minidist.model import ModelConfig
from minidist.parallel import ParallelModel
from minidist.train.config import TrainConfig
from minidist.train.optim import WarmupCosine

Batches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Run:
    """Everything a training loop holds; built by `minidist.train.loop.setup`, advanced by `train_loop`."""

    cfg: TrainConfig
    mcfg: ModelConfig
    env: DistEnv
    topo: Topology
    device: torch.device
    parallel: ParallelModel  # this rank's model and optimizer, and the step's operations
    schedule: WarmupCosine
    sampler: BatchSampler
    val_batches: Batches
    autocast: Callable[[], contextlib.AbstractContextManager]
    out: Path
    info: dict  # what run.json records
    start_step: int = 0
    eod_id: int | None = None  # --doc-mask: the token that ends each document (None: attention across documents)
    val_docs: list[torch.Tensor] | None = None  # --doc-mask: the document ids of each validation micro-batch

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    @property
    def barrier(self) -> Callable[[], None] | None:
        """A barrier of all ranks around file work (OUT, the checkpoint's steps), bounded by --ckpt-timeout: a rank
        still writing on a slow filesystem is not a hung rank. None on one process."""
        if self.env.world_size == 1:
            return None
        return functools.partial(self.topo.checkpoint_comm().barrier, self.device)

    def log(self, text: str) -> None:
        if self.is_main:
            print(text, flush=True)
