"""This process's place in the job: what torchrun says about it, the layout checked before any process group, the
process group itself, and the device.

Bad layouts fail here, in one line, before any rank waits for another: a layout that does not divide the world
size, a batch that does not split over the replicas, a model that cannot be cut over tp ranks or pp stages.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from minidist.comm.recorder import SIGNALS, FlightRecorder, recording
from minidist.comm.topology import ParallelDims, Topology
from minidist.train.config import ConfigError, TrainConfig, model_config


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


# What each dimension needs and the chapter that brings it. A chapter deletes its line when it lands.
NOT_AVAILABLE_YET: dict[str, tuple[str, str]] = {}


def resolve_parallel_dims(cfg: TrainConfig, world_size: int) -> ParallelDims:
    """The layout of this run, checked against the world size. Called before any process group is created."""
    rest = cfg.tp * cfg.pp * cfg.cp
    dp = cfg.dp if cfg.dp is not None else max(1, world_size // rest)
    try:
        dims = ParallelDims(dp=dp, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, ep=cfg.ep)
        dims.validate(world_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    for name, (what, chapter) in NOT_AVAILABLE_YET.items():
        if getattr(dims, name) > 1:
            raise ConfigError(f"--{name} {getattr(dims, name)}: {what} is not available yet (chapter {chapter})")
    if cfg.batch_size % (dims.dp * cfg.microbatches):
        raise ConfigError(f"batch_size {cfg.batch_size} is not divisible by dp*microbatches = "
                          f"{dims.dp}*{cfg.microbatches}; pick a multiple of {dims.dp * cfg.microbatches}")
    check_model_split(cfg, dims)
    return dims


def check_model_split(cfg: TrainConfig, dims: ParallelDims) -> None:
    """Chapters 08-11: can the model be cut over tp ranks, pp stages, cp ranks and ep ranks this way? One-line
    ConfigError if not."""
    from minidist.parallel.cp import validate_context_parallel
    from minidist.parallel.ep.expert import validate_expert_parallel
    from minidist.parallel.pp.pipeline import validate_pipeline
    from minidist.parallel.tp.tensor import validate_tensor_parallel

    mcfg = model_config(cfg)
    if cfg.sp and dims.tp == 1:
        raise ConfigError("--sp (sequence parallel) splits the sequence over tensor-parallel ranks: it needs --tp > 1")
    if dims.pp == 1 and cfg.virtual_stages > 1:
        raise ConfigError(f"--virtual-stages {cfg.virtual_stages} cuts each pipeline rank's layers into chunks: "
                          "it needs --pp > 1")
    try:
        validate_tensor_parallel(mcfg, dims.tp, cfg.seq_len, cfg.sp)
        validate_context_parallel(mcfg, dims.cp, cfg.cp_impl, cfg.seq_len, dims.tp, cfg.sp)
        validate_expert_parallel(mcfg, dims.ep, dims.dp * dims.cp)
        if dims.pp > 1:
            validate_pipeline(mcfg, dims.pp, cfg.microbatches, cfg.virtual_stages, cfg.schedule,
                              batch_size=cfg.batch_size // dims.dp)
    except ValueError as e:
        raise ConfigError(str(e)) from None


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
    return Topology(dims, env.rank, env.world_size, timeout=timeout, recorder=recorder), created


@contextlib.contextmanager
def joined(dims: ParallelDims, env: DistEnv, device: torch.device, cfg: TrainConfig) -> Iterator[Topology]:
    """The run's process groups (`init_distributed`, bounded by --comm-timeout) with a flight recorder: when the
    block raises (a collective past the timeout raises in the rank; bad settings excepted), or on SIGTERM or
    SIGUSR1 when this call created the process group (torchrun), each rank writes its recent calls to
    OUT/flight/rank{R}.json (`minidist.comm.recorder`). The default group is destroyed at the end if this call
    created it."""
    recorder = FlightRecorder(env.rank) if env.world_size > 1 else None
    topo, created = init_distributed(dims, env, device, timeout_s=cfg.comm_timeout, recorder=recorder)
    if recorder is not None:
        recorder.start()
    try:
        # Signals only where this run owns the process (torchrun's worker); a launcher or notebook keeps its own.
        with recording(recorder, Path(cfg.out), env.rank, ignore=(ConfigError,), signals=SIGNALS if created else ()):
            yield topo
    finally:
        if created:
            dist.destroy_process_group()


def barrier_for(device: torch.device) -> Callable[[], None]:
    """dist.barrier for ranks on `device`: on NCCL it names the rank's GPU (device_ids), which NCCL would otherwise
    guess from the rank number (wrong when ranks are not laid out on GPUs in order)."""
    if device.type == "cuda":
        return functools.partial(dist.barrier, device_ids=[device.index])
    return dist.barrier


def pick_device(requested: str, env: DistEnv) -> torch.device:
    """--device auto|cpu|cuda: this rank's device (cuda:LOCAL_RANK when CUDA is asked for or available)."""
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available; use --device cpu")
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")
