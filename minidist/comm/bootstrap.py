"""This process's place in a job, and joining the job's process groups.

What a launcher says about the process (torchrun's or srun's variables, read by `minidist.comm.backend`, or an
already initialised process group), the device the rank computes on, and the process group itself with the rank
grid sliced from it. The backend's own settings (NCCL's watchdog and flight record, the CUDA allocator) are set
here, before the first CUDA call and before the process group, where the user has not set them.
Nothing here knows about the trainer's settings: a bad request raises ValueError, the caller words it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.comm import backend
from minidist.comm.recorder import SIGNALS, FlightRecorder, recording
from minidist.comm.topology import ParallelDims, Topology

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class DistEnv(backend.Place):
    """This process's place in the job (`backend.Place`'s fields): from an initialised process group, else from the
    launcher's variables (`minidist.comm.backend.place`: torchrun's, else srun's, else one process). `launcher` is
    "initialised" when a process group existed already."""

    @classmethod
    def detect(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """One-line ValueError when the launcher's variables do not fit together (`backend.place`)."""
        env = os.environ if environ is None else environ
        if dist.is_available() and dist.is_initialized():  # e.g. minidist.comm.launch.run_ranks
            rank, world = dist.get_rank(), dist.get_world_size()
            local = int(env.get("LOCAL_RANK", rank))
            return cls(rank, world, local, int(env.get("LOCAL_WORLD_SIZE", world)), "initialised")
        found = backend.place(env)
        return cls(found.rank, found.world_size, found.local_rank, found.local_world_size, found.launcher)


def pick_device(requested: str, env: DistEnv) -> torch.device:
    """auto|cpu|cuda: this rank's device (cuda:LOCAL_RANK when CUDA is asked for or available; `backend.cuda_index`).
    On CUDA the allocator's settings (`backend.cuda_settings`) are set first: the allocator reads them once."""
    if requested not in DEVICES:
        raise ValueError(f"device {requested!r} is unknown; choose one of {DEVICES}")
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available; use --device cpu")
        index = backend.cuda_index(env, torch.cuda.device_count())
        announce(backend.apply_settings(backend.cuda_settings(os.environ), os.environ), env.rank)
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def announce(applied: dict[str, str], rank: int) -> None:
    """Say on rank 0 which backend settings this run set (a user's own values are never replaced)."""
    if applied and rank == 0:
        values = " ".join(f"{name}={value}" for name, value in applied.items())
        print(f"set (unset before; export your own to change): {values}", flush=True)


def init_distributed(dims: ParallelDims, env: DistEnv, device: torch.device,
                     timeout_s: float | None = None, recorder: FlightRecorder | None = None,
                     ckpt_timeout_s: float | None = None) -> tuple[Topology, bool]:
    """Join the process group (unless world size 1, or already joined) and slice the rank grid into groups.

    `timeout_s` bounds every collective of every group (the world group when this call creates it, and each group
    of the grid): a peer that stops answering ends the job instead of hanging it. `ckpt_timeout_s` bounds the
    topology's checkpoint group (`Topology.checkpoint_comm`: the barriers around writing files). Returns the
    topology and whether this call created the default group (the caller destroys it at the end). Every Comm of
    the topology records its calls into `recorder`, if given.
    """
    created = False
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    if env.world_size > 1 and not dist.is_initialized():
        # rank and world size passed explicitly: env:// reads only MASTER_ADDR/PORT then (srun sets no RANK).
        # device_id binds this rank to its GPU at once (NCCL creates the communicator eagerly, no device guess).
        dist.init_process_group(backend.backend_name(device.type), rank=env.rank,
                                device_id=device if device.type == "cuda" else None,
                                world_size=env.world_size, timeout=timeout)
        created = True
    ckpt_timeout = datetime.timedelta(seconds=ckpt_timeout_s) if ckpt_timeout_s is not None else None
    return Topology(dims, env.rank, env.world_size, timeout=timeout, recorder=recorder,
                    ckpt_timeout=ckpt_timeout, device=device), created


@contextlib.contextmanager
def joined(dims: ParallelDims, env: DistEnv, device: torch.device, timeout_s: float, out: Path,
           ignore: tuple[type[BaseException], ...] = (), ckpt_timeout_s: float | None = None) -> Iterator[Topology]:
    """The job's process groups (`init_distributed`, bounded by `timeout_s`, the checkpoint group by
    `ckpt_timeout_s`) with a flight recorder: when the block raises (a collective past the timeout raises in the
    rank on gloo; exceptions of the types in `ignore` excepted), or on SIGTERM or SIGUSR1 when this call created
    the process group (torchrun), each rank writes its recent calls to `out`/flight/rank{R}.json
    (`minidist.comm.recorder`). On NCCL a timeout is the watchdog's (`backend.nccl_settings`, set here first): it
    ends the process and leaves NCCL's own record in `out`/flight/. The default group is destroyed at the end if
    this call created it."""
    settings = backend.process_group_settings(device.type, env.world_size, out / "flight", os.environ)
    announce(backend.apply_settings(settings, os.environ), env.rank)
    recorder = FlightRecorder(env.rank) if env.world_size > 1 else None
    topo, created = init_distributed(dims, env, device, timeout_s=timeout_s, recorder=recorder,
                                     ckpt_timeout_s=ckpt_timeout_s)
    if recorder is not None:
        recorder.start()
    try:
        # Signals only where this run owns the process (torchrun's worker); a launcher or notebook keeps its own.
        with recording(recorder, out, env.rank, ignore=ignore, signals=SIGNALS if created else ()):
            yield topo
    finally:
        if created:
            dist.destroy_process_group()
