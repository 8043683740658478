"""Writing in OUT without ever writing through a symbolic link.

A run directory may come from someone else (a received run, resumed), and a link in it may point anywhere:
`OUT/loss.png -> ~/important` would turn that file into a PNG if the trainer opened the name. Every file the
trainer and the flight recorder (`comm/recorder.py`) write in OUT goes through here, which is why it sits at the
bottom of the package, beside `comm/`: whole files are written to a fresh temporary name (created with O_EXCL,
which never follows a link) and renamed over the target (a rename replaces a link itself, never what it points
to); appends open with O_NOFOLLOW. A link where a directory of the run should be is refused in one line.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # POSIX; Windows has no symlinks a user plants this way
LOCK_FRESH_S = 10.0  # an empty lock younger than this is a process between creating it and writing its owner


class LockHeld(ValueError):
    """Another live process holds the directory's lock."""


class LinkRefused(ValueError):
    """A path the trainer would write through is a symbolic link."""


def refuse_link(path: Path) -> None:
    """One-line LinkRefused if `path` is a symbolic link (a dangling one too)."""
    if Path(path).is_symlink():
        raise LinkRefused(f"{path} is a symbolic link; the trainer writes no file through a link (remove it, or "
                          "give another --out)")


def replace_file(path: Path, data: bytes | Callable[[BinaryIO], None], *, sync: bool = False) -> Path:
    """Write `data` (bytes, or a function that writes to a binary file) to `path` via a fresh temporary file in
    the same directory and a rename: a link at `path` is replaced, not followed; a reader never sees half a file."""
    path = Path(path)
    refuse_link(path.parent)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            data(f) if callable(data) else f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def append_text(path: Path, text: str) -> None:
    """Append `text` to `path` (created if missing); a link at `path` is refused (OSError ELOOP), never followed."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | NO_FOLLOW, 0o644)
    with os.fdopen(fd, "a") as f:
        f.write(text)


def create_empty(path: Path) -> None:
    """Create `path` as an empty file; FileExistsError if anything (a link too) is there already."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o644))


@contextlib.contextmanager
def locked(out: Path, name: str = ".lock", log: Callable[[str], None] = print) -> Iterator[None]:
    """Hold `out`/`name` (this pid and host) for the block, `out` created if missing: one process per directory
    (the trainer's OUT, prepare's --out). LockHeld (one line) while another live process holds it; a lock whose
    process is gone (its pid is dead on this host) is taken over, with a note."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lock, mine = out / name, f"{os.getpid()} {socket.gethostname()}\n"
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NO_FOLLOW, 0o644)
            break
        except FileExistsError:
            owner = lock_owner(lock)
            if owner is not None:
                raise LockHeld(f"--out {out} is in use by {owner} ({lock}); wait for it, give another --out, "
                               "or remove the lock if that process is gone") from None
            log(f"{lock}: its process is gone; taking it over")
            try:
                lock.unlink(missing_ok=True)
            except OSError as e:
                raise LockHeld(f"--out {out}: cannot remove the stale {lock} ({e.strerror})") from None
    else:
        raise LockHeld(f"--out {out}: could not take {lock}; another process is starting there")
    with os.fdopen(fd, "w") as f:
        f.write(mine)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if lock.read_text() == mine:
                lock.unlink()


def lock_owner(lock: Path) -> str | None:
    """Who holds `lock` ("process P on host H"), or None when it is stale: its process is dead on this host, or the
    file is not a lock at all. A lock of another host cannot be checked from here: it counts as held."""
    try:
        text = lock.read_text(errors="replace")
        if not text and time.time() - lock.stat().st_mtime < LOCK_FRESH_S:
            return "a process that is starting"  # created, its owner not yet written
        pid_text, host = text.split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return None
    if host == socket.gethostname():
        if pid == os.getpid():  # this process's own lock, left by an earlier holder in it that died without its finally
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass  # alive, another user's
    return f"process {pid} on host {host}"
