"""Priorities among batches, and the aging that keeps any of them from starving (issue 49).

Direction as in vLLM's `--scheduling-policy priority`: a LOWER value is more urgent. A batch's
priority is an integer in [MIN_BATCH_PRIORITY, MAX_BATCH_PRIORITY], 0 unless `submit --priority`
or the batch's `metadata.priority` says otherwise. Online requests outrank every batch: a batch
line's engine priority (`engine_priority`) lies past ONLINE's whatever its batch's priority.

Aging: for every `level_s` seconds a batch (or a waiting engine sequence) has waited, its
effective priority falls one level, down to MIN_BATCH_PRIORITY. A batch that newer batches
outrank by k levels is ahead of them once it is k * level_s seconds older than they are, so
no batch waits behind a stream of more urgent ones for more than (its priority - MIN) * level_s
seconds of age.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from batchmlx.core.engine_api import ENGINE_DEFAULTS
from batchmlx.core.request import BATCH_PRIORITY

MIN_BATCH_PRIORITY = -100  # the most urgent a batch can be (still after online requests)
MAX_BATCH_PRIORITY = 100  # the least urgent
DEFAULT_BATCH_PRIORITY = 0


@dataclass(frozen=True, slots=True)
class Aging:
    """Effective priority = priority - (seconds waited // level_s), never below `floor`."""

    level_s: float = ENGINE_DEFAULTS.priority_aging_s  # per level gained; 0: strict
    floor: int = MIN_BATCH_PRIORITY

    def __post_init__(self) -> None:
        if self.level_s < 0:
            raise ValueError("level_s must be >= 0")

    def effective(self, priority: int, waited_s: float) -> int:
        if self.level_s == 0 or waited_s <= 0 or priority <= self.floor:
            return priority
        return max(priority - int(waited_s // self.level_s), self.floor)


def engine_priority(batch_priority: int) -> int:
    """The engine priority (GenerationRequest.priority) of a line of a batch with this
    priority: BATCH_PRIORITY for the most urgent batch, so every online request (below
    BATCH_PRIORITY) stays ahead, and batches keep their order."""
    if not MIN_BATCH_PRIORITY <= batch_priority <= MAX_BATCH_PRIORITY:
        raise ValueError(f"batch priority {batch_priority} is out of range")
    return BATCH_PRIORITY + batch_priority - MIN_BATCH_PRIORITY


def engine_aging(level_s: float) -> Aging:
    """Aging of engine priorities: batch lines rise at most to BATCH_PRIORITY, never past
    online work."""
    return Aging(level_s, floor=BATCH_PRIORITY)


class Prioritized(Protocol):
    """A batch as claim_order reads it (the store's BatchRef)."""

    @property
    def priority(self) -> int: ...

    @property
    def created_at(self) -> int: ...


B = TypeVar("B", bound=Prioritized)


def claim_order(batches: Iterable[B], now: float, aging: Aging) -> list[B]:
    """The order a worker claims lines from `batches` (given oldest first): by effective
    priority, most urgent first; equal ones keep the given order (the sort is stable)."""
    return sorted(batches, key=lambda b: aging.effective(b.priority, now - b.created_at))
