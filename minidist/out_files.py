"""Writing in OUT without ever writing through a symbolic link.

A run directory may come from someone else (a received run, resumed), and a link in it may point anywhere:
`OUT/loss.png -> ~/important` would turn that file into a PNG if the trainer opened the name. Every file the
trainer and the flight recorder (`comm/recorder.py`) write in OUT goes through here, which is why it sits at the
bottom of the package, beside `comm/`: whole files are written to a fresh temporary name (created with O_EXCL,
which never follows a link) and renamed over the target (a rename replaces a link itself, never what it points
to); appends open with O_NOFOLLOW. A link where a directory of the run should be is refused in one line.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

NO_FOLLOW = getattr(os, "O_NOFOLLOW", 0)  # POSIX; Windows has no symlinks a user plants this way


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
