"""Fault injection for crash tests: `BATCHMLX_CRASH_AT=point:n` SIGKILLs this process the n-th
time `crash_point(point)` is reached (n defaults to 1; several specs may be comma-separated).

Read once at import; with the variable unset `crash_point` is a dict lookup on an empty dict.
Points: after_claim, mid_generation, after_result_write, before_finalize, mid_finalize,
after_finalize_files, inbox_after_submit.
"""

from __future__ import annotations

import os
import signal

ENV = "BATCHMLX_CRASH_AT"
POINTS = (
    "after_claim",  # claimed requests are leased, nothing ran yet
    "mid_generation",  # after an engine step
    "after_result_write",  # results committed, the batch not finalized
    "before_finalize",  # every request done, no file written
    "mid_finalize",  # output file written, error file and status not
    "after_finalize_files",  # both files written, status not changed
    "inbox_after_submit",  # an inbox file's batch committed, the file not moved yet
)


def _parse(spec: str) -> dict[str, int]:
    targets: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, nth = part.partition(":")
        if name not in POINTS:
            raise ValueError(f"{ENV}: unknown crash point {name!r}; known: {', '.join(POINTS)}")
        targets[name] = int(nth or 1)
    return targets


_TARGETS = _parse(os.environ.get(ENV, ""))
_SEEN: dict[str, int] = {}


def crash_point(name: str) -> None:
    """SIGKILL this process if `name` is armed and reached for the n-th time."""
    nth = _TARGETS.get(name)
    if nth is None:
        return
    _SEEN[name] = _SEEN.get(name, 0) + 1
    if _SEEN[name] == nth:
        os.kill(os.getpid(), signal.SIGKILL)
