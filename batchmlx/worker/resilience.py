"""How the worker outlives faults: which ones are transient, and how long to wait before the
next try. Pure, apart from asking the store which of its errors are transient."""

from __future__ import annotations

import errno
from dataclasses import dataclass

from batchmlx.store.errors import is_transient_db_error

# a full, over-quota or failing disk: the same write can succeed later
_TRANSIENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO})


def is_transient(exc: BaseException) -> bool:
    """A fault of the machine (locked database, full disk), not of one request or batch."""
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    return is_transient_db_error(exc)


@dataclass(slots=True)
class Backoff:
    """Delays of first, 2·first, 4·first, … capped at `cap`, until `reset`."""

    first: float = 0.5
    cap: float = 10.0
    _next: float = 0.0  # 0: the next delay is `first`

    def next(self) -> float:
        delay = self._next or self.first
        self._next = min(delay * 2, self.cap)
        return delay

    def reset(self) -> None:
        self._next = 0.0
