"""Which files some process still holds open for writing, where the OS can tell.

Linux tells through /proc: each `/proc/PID/fd/N` links to the open file, and
`/proc/PID/fdinfo/N` gives the open flags (octal). Processes of other users are not readable
unless we are root; where /proc is missing (macOS) nothing is known and the settle time alone
decides.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

PROC = Path("/proc")
_WRITING = (os.O_WRONLY, os.O_RDWR)


def can_tell(proc: Path = PROC) -> bool:
    return (proc / "self" / "fdinfo").is_dir()


def open_for_writing(paths: Iterable[Path], proc: Path = PROC) -> set[Path]:
    """The subset of `paths` (absolute, symlinks resolved) some process has open to write."""
    wanted = {str(p): p for p in paths}
    found: set[Path] = set()
    if not wanted or not can_tell(proc):
        return found
    try:
        pids = [d for d in os.listdir(proc) if d.isdigit()]
    except OSError:
        return found
    for pid in pids:
        fd_dir = proc / pid / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # gone, or not ours to read
            continue
        for fd in fds:
            try:
                path = wanted.get(os.readlink(fd_dir / fd))
            except OSError:
                continue
            if path is None or path in found:
                continue
            flags = _flags(proc / pid / "fdinfo" / fd)
            if flags is not None and flags & os.O_ACCMODE in _WRITING:
                found.add(path)
        if len(found) == len(wanted):
            break
    return found


def _flags(fdinfo: Path) -> int | None:
    try:
        text = fdinfo.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == "flags":
            return int(value.strip(), 8)
    return None
