"""Per-batch locks between the processes of one host (SQLite): `flock` on a small file.

A lock held by a process that dies is released with it, like PostgreSQL's advisory locks with
their connection. `flock` locks belong to an open file, so two tasks of one process exclude
each other too (POSIX record locks would not).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

from batchmlx.config import private_dir


def lock_path(folder: Path, key: str) -> Path:
    return folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.lock"


def try_lock(path: Path) -> int | None:
    """The open descriptor holding an exclusive lock on `path`, or None when another holds it."""
    private_dir(path.parent)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except BaseException:
        os.close(fd)
        raise
    return fd


def unlock(fd: int, path: Path, *, remove: bool) -> None:
    """Let go; `remove`: also delete the file, done only once the lock is needed no more (a
    process that opened the old file and locks it later finds the work finished)."""
    try:
        if remove:
            path.unlink(missing_ok=True)
    finally:
        os.close(fd)
