"""The torch this package runs on: the oldest release it supports and the torch.distributed names it calls.

A GPU node keeps the CUDA torch it already has (pyproject.toml admits `torch>=2.11`), so a name that only a newer
torch has would crash the first multi-GPU run with an AttributeError in the middle of a step: torch 2.11 and 2.12
have `all_gather_into_tensor` / `reduce_scatter_tensor`, not the `*_single` spellings 2.13 adds. The trainer's
preflight calls `check_torch` before any process group exists, so an unsupported torch fails in one line instead.
tests/test_architecture.py keeps `DISTRIBUTED_NAMES` equal to the names the package really uses, and within the
list of names torch 2.11 has.
"""

from __future__ import annotations

import re
from types import ModuleType

import torch
import torch.distributed as dist

OLDEST_TORCH = (2, 11)  # pyproject.toml's floor (tests/test_repo.py checks that they agree)

# Every torch.distributed attribute minidist/ reads (comm/ makes the calls; other layers name groups and ranks).
DISTRIBUTED_NAMES = frozenset({
    "GroupMember", "P2POp", "ProcessGroup", "ReduceOp", "TCPStore", "Work", "all_gather_into_tensor", "all_reduce",
    "all_to_all_single", "barrier", "batch_isend_irecv", "broadcast", "destroy_process_group",
    "get_process_group_ranks", "get_rank", "get_world_size", "group", "init_process_group", "irecv",
    "is_available", "is_initialized", "isend", "new_group", "reduce_scatter_tensor",
})


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string: '2.11.0+cu130' -> (2, 11); '2.13.0a0+git1234' -> (2, 13)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"cannot read a torch version from {version!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch(version: str | None = None, distributed: ModuleType = dist) -> None:
    """Raise ValueError, in one line, when this torch (or `version`) is older than OLDEST_TORCH or its
    torch.distributed (or `distributed`) lacks a name the package calls."""
    version = torch.__version__ if version is None else version
    oldest = ".".join(map(str, OLDEST_TORCH))
    if release(version) < OLDEST_TORCH:
        raise ValueError(f"torch {version} is older than {oldest}, the oldest this package supports; "
                         f"install torch>={oldest}")
    if not distributed.is_available():
        return  # a torch built without distributed runs single-process only; the launcher says so if asked for more
    missing = sorted(name for name in DISTRIBUTED_NAMES if not hasattr(distributed, name))
    if missing:
        raise ValueError(f"torch {version}'s torch.distributed lacks {', '.join(missing)}, which this package "
                         f"calls; install a torch>={oldest} built with distributed support")
