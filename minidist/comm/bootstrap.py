"""This process's place in a job, and joining the job's process groups.

What a launcher says about the process (torchrun's RANK / WORLD_SIZE / LOCAL_RANK, or an already initialised
process group), the device the rank computes on, and the process group itself with the rank grid sliced from it.
Nothing here knows about the trainer's settings: a bad request raises ValueError, the caller words it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.comm.recorder import SIGNALS, FlightRecorder, recording
from minidist.comm.topology import ParallelDims, Topology

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job: from an initialised process group, else from torchrun's variables."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def detect(cls) -> DistEnv:
        env = os.environ
        if dist.is_available() and dist.is_initialized():  # e.g. minidist.comm.launch.run_ranks
            rank = dist.get_rank()
            return cls(rank, dist.get_world_size(), int(env.get("LOCAL_RANK", rank)))
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


def pick_device(requested: str, env: DistEnv) -> torch.device:
    """auto|cpu|cuda: this rank's device (cuda:LOCAL_RANK when CUDA is asked for or available)."""
    if requested not in DEVICES:
        raise ValueError(f"device {requested!r} is unknown; choose one of {DEVICES}")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available; use --device cpu")
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_distributed(dims: ParallelDims, env: DistEnv, device: torch.device,
                     timeout_s: float | None = None, recorder: FlightRecorder | None = None) -> tuple[Topology, bool]:
    """Join the process group (unless world size 1, or already joined) and slice the rank grid into groups.

    `timeout_s` bounds every collective of every group (the world group when this call creates it, and each group
    of the grid): a peer that stops answering ends the job instead of hanging it. Returns the topology and
    whether this call created the default group (the caller destroys it at the end). Every Comm of the topology
    records its calls into `recorder`, if given.
    """
    created = False
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    if env.world_size > 1 and not dist.is_initialized():
        # device_id binds this rank to its GPU at once (NCCL creates the communicator eagerly, no device guess).
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=env.rank,
                                device_id=device if device.type == "cuda" else None,
                                world_size=env.world_size, timeout=timeout)
        created = True
    return Topology(dims, env.rank, env.world_size, timeout=timeout, recorder=recorder, device=device), created


@contextlib.contextmanager
def joined(dims: ParallelDims, env: DistEnv, device: torch.device, timeout_s: float, out: Path,
           ignore: tuple[type[BaseException], ...] = ()) -> Iterator[Topology]:
    """The job's process groups (`init_distributed`, bounded by `timeout_s`) with a flight recorder: when the block
    raises (a collective past the timeout raises in the rank; exceptions of the types in `ignore` excepted), or on
    SIGTERM or SIGUSR1 when this call created the process group (torchrun), each rank writes its recent calls to
    `out`/flight/rank{R}.json (`minidist.comm.recorder`). The default group is destroyed at the end if this
    call created it."""
    recorder = FlightRecorder(env.rank) if env.world_size > 1 else None
    topo, created = init_distributed(dims, env, device, timeout_s=timeout_s, recorder=recorder)
    if recorder is not None:
        recorder.start()
    try:
        # Signals only where this run owns the process (torchrun's worker); a launcher or notebook keeps its own.
        with recording(recorder, out, env.rank, ignore=ignore, signals=SIGNALS if created else ()):
            yield topo
    finally:
        if created:
            dist.destroy_process_group()
