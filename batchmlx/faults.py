"""Fault injection for the crash and fault tests, armed by environment variables and free when
none is set (`crash_point` is then a lookup in an empty dict). At `crash_point(point)`:

- `BATCHMLX_CRASH_AT=point:n` SIGKILLs this process the n-th time the point is reached;
- `BATCHMLX_FAIL_AT=point:n:KIND` raises there instead: KIND `ENOSPC` or `EIO` an OSError with
  that errno (a full or failing disk), `error` a RuntimeError (a bug);
- `BATCHMLX_PAUSE_AT=point:n` writes `$BATCHMLX_PAUSE_DIR/point.reached` and blocks until
  `point.go` appears there (a test acts in a known window, e.g. cancels during finalize).

n defaults to 1; `*` means every time. Several specs may be comma-separated.

Points: see POINTS below (inbox_after_submit is reached by the inbox, not a worker).
"""

from __future__ import annotations

import enum
import errno
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

ENV = "BATCHMLX_CRASH_AT"
FAIL_ENV = "BATCHMLX_FAIL_AT"
PAUSE_ENV = "BATCHMLX_PAUSE_AT"
PAUSE_DIR_ENV = "BATCHMLX_PAUSE_DIR"
POINTS = (
    "after_claim",  # claimed requests are leased, nothing ran yet
    "engine_step",  # an engine step about to run the model (a fault there fails its requests)
    "mid_generation",  # after an engine step
    "after_result_write",  # results committed, the batch not finalized
    "finalize_start",  # a batch's results read, its status not yet moved to finalizing
    "before_finalize",  # every request done, no file written
    "store_file",  # about to write a file under files/
    "mid_finalize",  # output file written, error file and status not
    "after_finalize_files",  # both files written, status not changed
    "inbox_after_submit",  # an inbox file's batch committed, the file not moved yet
    "worker_loop",  # between two ticks of the worker loop while online requests run
    "after_preemption",  # after an engine step that preempted sequences (their KV freed)
)


class Action(enum.Enum):
    KILL = "kill"
    FAIL = "fail"
    PAUSE = "pause"


@dataclass(frozen=True, slots=True)
class _Target:
    action: Action
    nth: int | None  # None: every time
    kind: str = ""  # FAIL: ENOSPC, EIO or error


def _parse(spec: str, action: Action, env: str = ENV) -> dict[str, _Target]:
    targets: dict[str, _Target] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, rest = part.partition(":")
        nth, _, kind = rest.partition(":")
        if name not in POINTS:
            raise ValueError(f"{env}: unknown fault point {name!r}; known: {', '.join(POINTS)}")
        if action is Action.FAIL and kind not in _RAISERS:
            raise ValueError(f"{env}: {part!r} needs a kind: {', '.join(_RAISERS)}")
        targets[name] = _Target(action, None if nth == "*" else int(nth or 1), kind)
    return targets


def _os_error(code: int) -> OSError:
    return OSError(code, f"{os.strerror(code)} (injected)")


_RAISERS = {
    "ENOSPC": lambda point: _os_error(errno.ENOSPC),
    "EIO": lambda point: _os_error(errno.EIO),
    "error": lambda point: RuntimeError(f"injected fault at {point}"),
}

_TARGETS = {
    **_parse(os.environ.get(PAUSE_ENV, ""), Action.PAUSE, PAUSE_ENV),
    **_parse(os.environ.get(FAIL_ENV, ""), Action.FAIL, FAIL_ENV),
    **_parse(os.environ.get(ENV, ""), Action.KILL),
}
_SEEN: dict[str, int] = {}


def crash_point(name: str) -> None:
    """Kill, raise or pause here if `name` is armed and reached for the n-th time."""
    target = _TARGETS.get(name)
    if target is None:
        return
    _SEEN[name] = _SEEN.get(name, 0) + 1
    if target.nth is not None and _SEEN[name] != target.nth:
        return
    if target.action is Action.KILL:
        os.kill(os.getpid(), signal.SIGKILL)
    elif target.action is Action.FAIL:
        raise _RAISERS[target.kind](name)
    else:
        folder = Path(os.environ[PAUSE_DIR_ENV])
        (folder / f"{name}.reached").touch()
        while not (folder / f"{name}.go").exists():
            time.sleep(0.02)  # blocks the event loop on purpose: nothing moves meanwhile
