"""The running batch's width sized to the machine: a controller the engine feeds after each step.

Pure logic (no MLX): it sees what one step did (tokens generated, seconds, sequences running and
waiting, KV blocks free, preemptions) and answers the running limit the scheduler admits batch
work up to. It starts at `initial` and doubles while the throughput measured over a window of
steps at full width still rises by `gain`, the KV pool is projected to hold the wider batch with
room to grow, and the hard cap (`--max-batch-size`) allows. The first window that does not gain
settles it on the best width seen. While it grows, queued work that all fits (within the cap
and the KV pool at its longest) is admitted at once rather than through a measurement window at
each width: measuring can only pick among widths the work fills, and on every machine measured
throughput rose with the width that far; a tail of requests that waited through the ramp at
low width is what it would cost. A step that preempted shrinks it (memory pressure) and
remembers that width as a ceiling, so it never grows back into the same wall (no preemption
storm, no oscillation). An idle engine (nothing running or waiting) forgets the measurements,
so the next workload is measured afresh from the width reached.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from batchmlx.core.engine_api import EngineSettings


class WidthPhase(enum.Enum):
    GROWING = "growing"  # measuring each width, doubling while throughput rises
    SETTLED = "settled"  # on the best width seen (or a memory ceiling)


INITIAL_WIDTH = 32  # the width a fresh engine starts at (the old fixed default)
FULL = 0.75  # a step counts toward a width's measurement with at least this share of it running


def initial_width(settings: EngineSettings) -> int:
    """The running width an engine with these settings starts at."""
    if settings.adaptive_width and not settings.simple:
        return min(INITIAL_WIDTH, settings.running_bound)
    return settings.running_bound


@dataclass(frozen=True, slots=True)
class WidthPolicy:
    cap: int  # the hard bound (--max-batch-size)
    initial: int = INITIAL_WIDTH
    floor: int = 4  # never shrink below this
    window_steps: int = 12  # steps at full width per throughput measurement
    gain: float = 1.05  # a wider batch must be this much faster to keep growing
    growth_room: float = 1.5  # blocks per running sequence grow about this much before it ends
    shrink: float = 0.75  # the width after a step that preempted, times the running count
    online_cap: int = 32  # batch admissions stop above this while online requests run

    def __post_init__(self) -> None:
        if self.cap < 1 or self.floor < 1 or self.initial < 1 or self.window_steps < 1:
            raise ValueError("cap, floor, initial and window_steps must be positive")
        if self.gain < 1.0 or not 0.0 < self.shrink < 1.0 or self.growth_room < 1.0:
            raise ValueError("gain and growth_room must be >= 1 and shrink in (0, 1)")


@dataclass(frozen=True, slots=True)
class StepReport:
    """What one engine step did, as the controller needs it."""

    generated: int  # tokens sampled in the step
    seconds: float  # wall time of the whole step
    running: int  # sequences running after the step
    waiting: bool  # sequences wait for admission after the step
    blocks_used: int  # KV blocks held by running sequences
    blocks_total: int  # usable KV blocks in the pool
    preempted: int = 0  # sequences the step preempted for memory
    queued: int = 0  # batch sequences waiting for admission (0 where not counted)
    queued_blocks: int = 0  # KV blocks the queued ones would hold at their longest


@dataclass(frozen=True, slots=True)
class WidthChange:
    step: int
    old: int
    new: int
    reason: str  # "faster", "plateau", "memory", "memory-bound", "fits"
    tok_s: float | None = None  # throughput measured at `old`, when a window ended


class WidthController:
    def __init__(self, policy: WidthPolicy) -> None:
        self.policy = policy
        self.limit = min(policy.initial, policy.cap)
        self.phase = WidthPhase.GROWING
        self.ceiling = policy.cap  # lowered by memory pressure, lifted when the engine idles
        self.best_tok_s: float | None = None
        self.best_limit = self.limit
        self.measured: dict[int, float] = {}  # width -> tok/s of its last full window
        self.changes: deque[WidthChange] = deque(maxlen=64)  # the latest, for logs and reports
        self._steps = 0
        self._win_steps = 0
        self._win_tokens = 0
        self._win_s = 0.0
        self._filled = False  # running reached the limit since the last change

    def observe(self, r: StepReport) -> int:
        """Feed one step; returns the running limit for the next admissions."""
        self._steps += 1
        p = self.policy
        if r.running == 0 and not r.waiting:
            self._idle()
            return self.limit
        if r.preempted:
            self._memory_shrink(r)
            return self.limit
        if self.phase is WidthPhase.SETTLED:
            return self.limit
        if self._admit_all(r):
            return self.limit
        if not self._filled:
            # measure only a full batch: the ramp (admissions, prefills) is not the width's rate
            if r.running < self.limit and r.waiting:
                return self.limit
            self._filled = True
            return self.limit
        if r.running < self.limit * FULL:
            # not this width's rate: the work ran out, or admissions were held back (online
            # requests running, the pool blocked)
            return self.limit
        self._win_steps += 1
        self._win_tokens += r.generated
        self._win_s += r.seconds
        if self._win_steps < p.window_steps or self._win_s <= 0.0:
            return self.limit
        tok_s = self._win_tokens / self._win_s
        self.measured[self.limit] = tok_s
        if self.best_tok_s is not None and tok_s < self.best_tok_s * p.gain:
            self._set(self.best_limit, "plateau", tok_s)
            self.phase = WidthPhase.SETTLED
            return self.limit
        self.best_tok_s, self.best_limit = tok_s, self.limit
        wider = min(p.cap, self.ceiling, self.limit * 2)
        if wider <= self.limit:
            self.phase = WidthPhase.SETTLED
            self._reset_window()
            return self.limit
        if not self._fits(wider, r):
            self.phase = WidthPhase.SETTLED
            self.changes.append(WidthChange(self._steps, self.limit, self.limit,
                                            "memory-bound", tok_s))  # fmt: skip
            self._reset_window()
            return self.limit
        self._set(wider, "faster", tok_s)
        return self.limit

    def admission_limit(self, online_running: int) -> int:
        """The width batch work is admitted up to: lower while online requests run, so their
        per-token latency stays that of a narrow batch (running ones are never preempted)."""
        if online_running:
            return min(self.limit, max(self.policy.online_cap, online_running))
        return self.limit

    # -- internals -------------------------------------------------------------------------

    def _fits(self, width: int, r: StepReport) -> bool:
        """The pool, projected from the blocks a running sequence holds now (grown by
        growth_room before it ends), holds `width` sequences."""
        if r.running == 0:
            return True
        per_seq = r.blocks_used / r.running
        return per_seq * self.policy.growth_room * width <= r.blocks_total

    def _admit_all(self, r: StepReport) -> bool:
        """Widen to running + queued when all of it fits: the cap, a memory ceiling, and the
        pool (the running grown by growth_room, the queued at their longest)."""
        wanted = r.running + r.queued
        if not r.queued or wanted <= self.limit or wanted > min(self.policy.cap, self.ceiling):
            return False
        if r.blocks_used * self.policy.growth_room + r.queued_blocks > r.blocks_total:
            return False
        self._set(wanted, "fits", None)
        return True

    def _memory_shrink(self, r: StepReport) -> None:
        p = self.policy
        new = max(p.floor, min(self.limit - 1, int(r.running * p.shrink)))
        new = min(new, self.limit)
        self.ceiling = new
        self.phase = WidthPhase.SETTLED
        self.best_limit = min(self.best_limit, new)
        self._set(new, "memory", None)

    def _idle(self) -> None:
        self.phase = WidthPhase.GROWING
        self.ceiling = self.policy.cap
        self.best_tok_s = None
        self.best_limit = self.limit
        self._reset_window()

    def _set(self, new: int, reason: str, tok_s: float | None) -> None:
        if new != self.limit or tok_s is not None:
            self.changes.append(WidthChange(self._steps, self.limit, new, reason, tok_s))
        self.limit = new
        self._reset_window()

    def _reset_window(self) -> None:
        self._win_steps = self._win_tokens = 0
        self._win_s = 0.0
        self._filled = False
