"""What the launcher and the backend say, and the decisions that follow from them.

Every function here is pure: it reads the environment it is given (a `Mapping[str, str]`, `os.environ` in a real
run, a dict in a test) and returns a decision; only `apply_settings` writes, and only what is not set already.

Where a process sits in a job, in this order:

1. torchrun (or any launcher that sets RANK and WORLD_SIZE): RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE. They win
   over SLURM's: torchrun inside an sbatch script sees both sets, and its own are the workers' places.
2. srun without torchrun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID of a job step (SLURM_STEP_ID is set). An sbatch
   script's own process also sees SLURM_PROCID=0 and SLURM_NTASKS=N but is one process (no step): it runs alone.
   The rendezvous then needs MASTER_ADDR and MASTER_PORT, which srun does not set.
3. Otherwise one process.

The NCCL settings (torch 2.11-2.13, `torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp` and `FlightRecorder.hpp`): a
collective past its timeout is found by the watchdog thread, not raised in Python; TORCH_NCCL_ASYNC_ERROR_HANDLING=3
tears the process down without aborting the communicators (the mode the flight recorder can dump in; 1 aborts them
first and can hang in the abort), TORCH_NCCL_DUMP_ON_TIMEOUT=1 makes the watchdog write NCCL's own flight record
of the last TORCH_FR_BUFFER_SIZE collectives to TORCH_FR_DUMP_TEMP_FILE + rank. Their defaults in these versions
are close (3, dump on, 2000 entries, ~/.cache/torch/): set explicitly so the behaviour does not depend on the torch
build and the record lands in OUT/flight/ beside ours. A value the user exported, under either of its names, is kept.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

LAUNCHERS = ("single", "torchrun", "slurm")
DEFAULT_PORT_HINT = 29500
NCCL_TRACE_ENTRIES = 2000  # collectives kept in NCCL's flight record (torch's default; the dump needs > 0)

# Each setting: (the name we set, its older names torch still reads). The first found wins in torch, so a user's
# value under any name is kept.
NCCL_ALIASES: dict[str, tuple[str, ...]] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": ("NCCL_ASYNC_ERROR_HANDLING",),
    "TORCH_NCCL_DUMP_ON_TIMEOUT": (),
    "TORCH_FR_BUFFER_SIZE": ("TORCH_NCCL_TRACE_BUFFER_SIZE",),
    "TORCH_FR_DUMP_TEMP_FILE": ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",),
}
CUDA_ALLOC_NAMES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the second: torch's device-generic name


@dataclass(frozen=True)
class Place:
    """Where this process sits in the job, and who said so (one of LAUNCHERS)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "single"


def place(environ: Mapping[str, str]) -> Place:
    """This process's place from the launcher's variables; one-line ValueError when they do not fit together or a
    multi-process job has no rendezvous address."""
    if "RANK" in environ or "WORLD_SIZE" in environ:
        found = _torchrun_place(environ)
    elif "SLURM_PROCID" in environ and ("SLURM_STEP_ID" in environ or "SLURM_STEPID" in environ):
        found = _slurm_place(environ)
    else:
        return Place()
    check_place(found, _slurm_size_name(environ) if found.launcher == "slurm" else None)
    if found.world_size > 1:
        check_rendezvous(environ, found.launcher)
    return found


def _torchrun_place(environ: Mapping[str, str]) -> Place:
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in environ]
    if missing:
        given = "RANK" if "RANK" in environ else "WORLD_SIZE"
        raise ValueError(f"{missing[0]} not set but {given} is: a launcher sets both (torchrun does); "
                         "set both or neither")
    world = _int(environ, "WORLD_SIZE")
    # A hand-set RANK/WORLD_SIZE without LOCAL_*: one node, this process on device 0 unless told otherwise.
    local_world = _int(environ, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in environ else world
    return Place(_int(environ, "RANK"), world, _int(environ, "LOCAL_RANK", 0), local_world, "torchrun")


def _slurm_place(environ: Mapping[str, str]) -> Place:
    world = _int(environ, _slurm_size_name(environ), 1)
    local_world = tasks_on_node(environ.get("SLURM_STEP_TASKS_PER_NODE", environ.get("SLURM_TASKS_PER_NODE", "")),
                                _int(environ, "SLURM_NODEID", 0))
    return Place(_int(environ, "SLURM_PROCID"), world, _int(environ, "SLURM_LOCALID", 0),
                 local_world if local_world is not None else world, "slurm")


def _slurm_size_name(environ: Mapping[str, str]) -> str:
    # SLURM_STEP_NUM_TASKS is the step's size (srun -n inside a bigger allocation); SLURM_NTASKS the allocation's.
    return "SLURM_STEP_NUM_TASKS" if "SLURM_STEP_NUM_TASKS" in environ else "SLURM_NTASKS"


def tasks_on_node(spec: str, node: int) -> int | None:
    """Tasks on node `node` from SLURM's compressed list ("4(x2),3": 4 on nodes 0 and 1, 3 on node 2); None if
    the list is empty, malformed or too short."""
    counts: list[int] = []
    for item in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            return None
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else None


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    if name not in environ and default is not None:
        return default
    value = environ[name]
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def check_place(found: Place, size_name: str | None = None) -> None:
    """One-line ValueError unless 0 <= rank < world_size and 0 <= local_rank < local_world_size; `size_name`: the
    variable that gave the world size (srun: SLURM_STEP_NUM_TASKS or SLURM_NTASKS)."""
    names = {"torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
             "slurm": ("SLURM_PROCID", size_name or "SLURM_NTASKS", "SLURM_LOCALID", "tasks on this node")}
    rank, world, local, local_world = names.get(found.launcher, ("rank", "world size", "local rank", "local size"))
    if found.world_size < 1:
        raise ValueError(f"{world}={found.world_size}: a job has at least one process")
    if not 0 <= found.rank < found.world_size:
        raise ValueError(f"{rank}={found.rank} is outside 0..{found.world_size - 1} ({world}={found.world_size})")
    if not 0 <= found.local_rank < max(found.local_world_size, 1):
        raise ValueError(f"{local}={found.local_rank} is outside 0..{found.local_world_size - 1} "
                         f"({local_world}={found.local_world_size})")


def check_rendezvous(environ: Mapping[str, str], launcher: str) -> None:
    """A job of several processes meets at MASTER_ADDR:MASTER_PORT (torchrun sets them; srun does not)."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(name)]
    if missing:
        how = ('export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1) '
               f"MASTER_PORT={DEFAULT_PORT_HINT} before srun" if launcher == "slurm"
               else "launch with torchrun, which sets them")
        raise ValueError(f"{' and '.join(missing)} not set: the {launcher} job's processes cannot meet; {how}")
    port = environ["MASTER_PORT"]
    if not port.strip().isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"MASTER_PORT={port!r} is not a port number (1..65535), e.g. {DEFAULT_PORT_HINT}")


def cuda_index(found: Place, device_count: int) -> int:
    """The CUDA device of this process: its local rank, or 0 when srun gave each task its own single GPU
    (`--gpus-per-task=1`: every task sees one device); ValueError when the node has too few."""
    if found.local_rank < device_count:
        return found.local_rank
    if device_count == 1 and found.launcher == "slurm":
        return 0
    raise ValueError(f"local rank {found.local_rank} needs {found.local_rank + 1} CUDA devices, this node shows "
                     f"{device_count}: start at most {device_count} processes per node (or check CUDA_VISIBLE_DEVICES)")


def backend_name(device_type: str) -> str:
    """The process-group backend for ranks computing on `device_type`: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device_type == "cuda" else "gloo"


def process_group_settings(device_type: str, world_size: int, flight_dir: Path,
                           environ: Mapping[str, str]) -> dict[str, str]:
    """What to set before a process group on `device_type` ranks: NCCL's settings for a job of several processes
    on CUDA (`nccl_settings`), nothing for gloo or one process (no process group, no watchdog)."""
    if world_size > 1 and backend_name(device_type) == "nccl":
        return nccl_settings(flight_dir, environ)
    return {}


def nccl_settings(flight_dir: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The TORCH_NCCL_* / TORCH_FR_* values the trainer sets on NCCL, minus those the user set (under any name):
    a timeout ends the process and leaves NCCL's flight record as `flight_dir`/nccl_rank_R."""
    wanted = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
              "TORCH_FR_BUFFER_SIZE": str(NCCL_TRACE_ENTRIES),
              "TORCH_FR_DUMP_TEMP_FILE": str(flight_dir / "nccl_rank_")}
    return {name: value for name, value in wanted.items()
            if not any(n in environ for n in (name, *NCCL_ALIASES[name]))}


def cuda_settings(environ: Mapping[str, str]) -> dict[str, str]:
    """expandable_segments on CUDA unless the user configured the allocator: memory freed between steps of
    different shapes is reused instead of fragmenting the cache (read when the allocator starts: set before)."""
    if any(name in environ for name in CUDA_ALLOC_NAMES):
        return {}
    return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def apply_settings(settings: Mapping[str, str], environ: MutableMapping[str, str]) -> dict[str, str]:
    """Set each of `settings` that `environ` does not hold yet (never replace a user's value); return those set."""
    applied = {}
    for name, value in settings.items():
        if name not in environ:
            environ[name] = value
            applied[name] = value
    return applied
