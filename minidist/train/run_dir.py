"""The output directory OUT: a run is never destroyed by accident.

OUT holds a run when it has any of `checkpoints/`, `metrics.jsonl` or `run.json`. A new run into such an OUT is
refused (one line) unless it says what to do with the old one: `--resume` continues it, `--overwrite` replaces it.
A `loss.png` or `flight/` without a run is someone's file all the same: only `--overwrite` replaces it.
`--overwrite` removes the trainer's own files only (RUN_FILES), and only when they look like the trainer's: a
`checkpoints/` or `flight/` holding a file the trainer never writes (`foreign_files`) is refused, naming it.
Anything else in OUT (notes, data, other programs' outputs) stays. A symbolic link where the trainer would write
is refused (or, with --overwrite, removed: never followed), so nothing outside OUT is written or deleted. One
process at a time: rank 0 holds OUT/.lock (its pid and host) for the whole run (`locked`). `check_out` runs on
every rank before anything is built; `prepare_out` then waits for all ranks (so none checks an OUT that rank 0
is already changing) and, on rank 0, clears and creates OUT.

Several ranks share OUT: rank 0 creates each checkpoint's directory, every rank writes its file into it, rank 0
reads every rank's note. That needs one filesystem every node sees (NFS, Lustre, GPFS; not a node's local disk),
an assumption `check_shared` turns into a check, when OUT is first prepared, instead of a failure mid-checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from minidist import out_files
from minidist.comm.communicator import Comm
from minidist.train import checkpoint, dashboard, profiling
from minidist.train.config import ConfigError, TrainConfig

RUN_MARKERS = ("checkpoints", "metrics.jsonl", "run.json")  # any of these: OUT holds a run
# what the trainer writes, and all that --overwrite removes (tensorboard/ and profile/: --tensorboard, --profile-steps)
RUN_FILES = (*RUN_MARKERS, "loss.png", "flight", dashboard.DIRECTORY, profiling.DIRECTORY, "tokenizer.json")
HOST_BYTES = 64  # a host name as check_shared gathers it (longer names are cut)
SHARED_WAIT_S = 5.0  # how long a rank looks for rank 0's token: a network filesystem may show a new file late
LOCK = ".lock"
# What the trainer writes inside checkpoints/ and flight/ (temporary names included: out_files' `.NAME.HEX.tmp`).
_TMP = r"(\.[\w.-]+\.[0-9a-f]{8}\.tmp)"
OWN_CHECKPOINT_ENTRY = re.compile(rf"latest|\.latest\.tmp|(\.tmp_)?step_\d{{6,}}|{_TMP}")
OWN_STEP_ENTRY = re.compile(rf"meta\.json|rank\d+\.(pt|sha256)|{_TMP}")
OWN_FLIGHT_ENTRY = re.compile(rf"rank\d+\.json(\.tmp)?|{_TMP}|nccl_rank_?\d+[\w.-]*")
OWN_BOARD_ENTRY = re.compile(r"events\.out\.tfevents\.[\w.-]+")  # SummaryWriter's names
OWN_PROFILE_ENTRY = re.compile(r"rank\d+_steps\d+-\d+\.json|\.trace\.\w+")  # profiling.StepProfiler's


def check_out(cfg: TrainConfig) -> None:
    """One-line ConfigError if OUT cannot be written, or holds a run (or a file of the trainer's names) that this
    one would destroy, or a link the run would write through, or files --overwrite would delete that are not the
    trainer's."""
    out = Path(cfg.out)  # as written to (the command line expanded a '~': config.config_from_values)
    existing = next(p for p in (out, *out.parents) if p.exists())  # OUT, or the directory it would be made in
    if not existing.is_dir():
        where = "is a file" if existing == out else f"cannot be created: {existing} is a file"
        raise ConfigError(f"--out {cfg.out} {where}; give a directory")
    if not _can_write(existing):
        raise ConfigError(f"--out {cfg.out}: cannot write in {existing} (permission or read-only filesystem)")
    _check_own_files(out, cfg)
    found = [name for name in RUN_MARKERS if os.path.lexists(out / name)]
    if found and not (cfg.resume or cfg.overwrite):
        raise ConfigError(f"--out {cfg.out} already holds a run ({', '.join(found)}); continue it with --resume "
                          "or replace it with --overwrite")
    if cfg.resume and not found:  # a typo in --out must not silently start over
        raise ConfigError(f"--resume: --out {cfg.out} holds no run (no {', '.join(RUN_MARKERS)}); check the path, "
                          "or leave out --resume to start a new run there")
    if found and cfg.resume:
        try:
            step = checkpoint.latest_step(out / "checkpoints")
        except ValueError as e:
            raise ConfigError(f"cannot resume: {e}") from None
        if step is None:  # starting at step 0 would replace the run's metrics
            raise ConfigError(f"--resume: {out / 'checkpoints'} holds no checkpoint, but OUT holds a run "
                              f"({', '.join(found)}); start it again with --overwrite instead of --resume")


def _check_own_files(out: Path, cfg: TrainConfig) -> None:
    """The checks of the trainer's names in OUT that do not depend on a run being there (see the module)."""
    if cfg.overwrite:
        foreign = foreign_files(out)
        if foreign:
            raise ConfigError(f"--overwrite would delete {foreign[0]}, which the trainer did not write; move it out "
                              "of OUT (or give another --out)")
        return
    links = [p for p in (out / LOCK, *(out / n for n in RUN_FILES), *_entries(out / "checkpoints"),
                         *_entries(out / "flight")) if p.is_symlink()]
    if links:
        raise ConfigError(f"--out {out}: {links[0]} is a symbolic link; the trainer writes nothing through a link "
                          "(remove it, or replace the run with --overwrite)")
    others = [n for n in RUN_FILES if n not in RUN_MARKERS and os.path.lexists(out / n)]
    if others and not any(os.path.lexists(out / n) for n in RUN_MARKERS):
        raise ConfigError(f"--out {out} holds {', '.join(others)} but no run: a run would replace it; give "
                          "--overwrite to let it, or another --out")


def _entries(directory: Path) -> list[Path]:
    """The entries of `directory` and of its step directories (nothing if it is missing or a link)."""
    if not directory.is_dir() or directory.is_symlink():
        return []
    found = []
    for path in directory.iterdir():
        found.append(path)
        if path.is_dir() and not path.is_symlink():
            found += list(path.iterdir())
    return found


def foreign_files(out: Path) -> list[Path]:
    """What --overwrite would delete that the trainer never writes: a `run.json`, `metrics.jsonl` or `loss.png`
    that is not a file (a link is fine: unlinked, never followed), and any entry of `checkpoints/` or `flight/`
    (or `tensorboard/`, `profile/`) not named as the trainer names its own (a user's `checkpoints/my_model.bin`)."""
    foreign = [out / n for n in ("run.json", "metrics.jsonl", "loss.png")
               if (out / n).exists() and not (out / n).is_symlink() and not (out / n).is_file()]
    for name, own in (("checkpoints", OWN_CHECKPOINT_ENTRY), ("flight", OWN_FLIGHT_ENTRY),
                      (dashboard.DIRECTORY, OWN_BOARD_ENTRY), (profiling.DIRECTORY, OWN_PROFILE_ENTRY)):
        root = out / name
        if not root.is_dir() or root.is_symlink():
            foreign += [root] if root.exists() and not root.is_symlink() else []  # a file named checkpoints
            continue
        for path in root.iterdir():
            if not own.fullmatch(path.name):
                foreign.append(path)
            elif name == "checkpoints" and path.is_dir() and not path.is_symlink():
                foreign += [p for p in path.iterdir() if not OWN_STEP_ENTRY.fullmatch(p.name) or p.is_dir()]
    return foreign


@contextlib.contextmanager
def locked(out: Path, is_main: bool, log: Callable[[str], None] = print) -> Iterator[None]:
    """Rank 0 holds OUT/.lock (pid and host) for the block: a second run on OUT is refused in one line while this
    one lives. A lock whose process is gone (its pid is dead on this host) is taken over, with a note
    (`out_files.locked`, which `python -m minidist.data prepare` holds on its --out too)."""
    if not is_main:
        yield
        return
    try:
        held = out_files.locked(out, LOCK, log)
        held.__enter__()
    except out_files.LockHeld as e:
        raise ConfigError(str(e)) from None
    try:
        yield
    finally:
        held.__exit__(None, None, None)


def _can_write(directory: Path) -> bool:
    """Try it: permission bits do not tell about read-only mounts, and root passes every bit check."""
    try:
        with tempfile.TemporaryFile(dir=directory):
            return True
    except OSError:
        return False


def prepare_out(out: Path, *, overwrite: bool, is_main: bool, barrier: Callable[[], None] | None = None) -> None:
    """After every rank's `check_out` (the barrier), rank 0 removes the old run if `overwrite`, then creates OUT."""
    if barrier is not None:
        barrier()
    if not is_main:
        return
    if overwrite:
        clear_run(out)
    out.mkdir(parents=True, exist_ok=True)


def clear_run(out: Path) -> list[str]:
    """Remove the trainer's files from OUT (nothing else); return the names removed. A symlink is unlinked, never
    followed: what it points to is not the trainer's."""
    removed = []
    for name in RUN_FILES:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif os.path.lexists(path):
            path.unlink()
        else:
            continue
        removed.append(name)
    return removed


def check_shared(out: Path, comm: Comm, device: torch.device) -> None:
    """Every rank of `comm` must see the files rank 0 writes in OUT. Rank 0 writes a token named by a fresh nonce
    (a name no node has looked up: no cached "missing" answer), every rank reads it back, the answers and host
    names are gathered, and every rank raises the same one-line ConfigError naming the ranks that cannot see it.
    Collective; after `prepare_out`."""
    if comm.size == 1:
        return
    nonce = torch.tensor([secrets.randbits(62) if comm.rank == 0 else 0], dtype=torch.int64, device=device)
    comm.broadcast(nonce, src=0)
    token, text = out / f".shared_check_{int(nonce[0])}", f"{int(nonce[0])}\n"
    if comm.rank == 0:
        token.write_text(text)
    comm.barrier(device)
    host = socket.gethostname().encode()[:HOST_BYTES].ljust(HOST_BYTES, b"\0")
    mine = torch.tensor([*host, int(_sees(token, text))], dtype=torch.uint8, device=device)
    rows = comm.all_gather(mine.unsqueeze(0)).tolist()  # after it, no rank still reads the token
    if comm.rank == 0:
        token.unlink(missing_ok=True)
    hosts = [bytes(row[:HOST_BYTES]).rstrip(b"\0").decode(errors="replace") for row in rows]
    blind = [f"rank {r} on host {hosts[r]}" for r, row in enumerate(rows) if not row[HOST_BYTES]]
    if blind:
        raise ConfigError(f"--out {out} must be on a filesystem every node shares: {', '.join(blind)} cannot see "
                          f"{token.name}, written there by rank 0 on host {hosts[0]} (checkpoints need one OUT for "
                          "all ranks; a node's local disk is not)")


def _sees(token: Path, text: str) -> bool:
    """Whether this rank reads `token` with `text`, looking again for up to SHARED_WAIT_S."""
    deadline = time.monotonic() + SHARED_WAIT_S
    while True:
        if _read_token(token) == text:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)


def _read_token(token: Path) -> str | None:
    try:
        return token.read_text()
    except OSError:
        return None
