"""The scheduler's waiting queue: preempted sequences first, then new ones by priority and
prefix group."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from batchmlx.core.priority import Aging
from batchmlx.core.sequence import Sequence


class WaitingQueue:
    """Waiting sequences in admission order.

    Preempted sequences come first (the earliest admitted first). New arrivals follow by
    priority (online requests before batch work), and within a priority in groups keyed by
    their first full block, so requests sharing a system prompt sit together; groups keep the
    FIFO order of their first member, and members keep FIFO order within a group.

    With `aging`, batch work rises a level for every `aging.level_s` seconds it has waited
    (core/priority.py), a group by its longest-waiting member, so a less urgent batch's lines
    are not overtaken forever by newer, more urgent ones; equal effective priorities keep the
    order above.
    """

    def __init__(
        self,
        block_size: int,
        grouping: bool,
        aging: Aging | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._block_size = block_size
        self._grouping = grouping
        self._aging = aging
        self._clock = clock
        self._front: list[Sequence] = []
        # priority -> group key -> members (dicts as ordered sets)
        self._groups: dict[int, dict[object, dict[Sequence, None]]] = {}

    def __len__(self) -> int:
        return len(self._front) + sum(
            len(g) for groups in self._groups.values() for g in groups.values()
        )

    def __bool__(self) -> bool:
        return bool(self._front or self._groups)

    def _key(self, seq: Sequence) -> object:
        if self._grouping and seq.num_prompt_tokens >= self._block_size:
            return tuple(seq.token_ids[: self._block_size])
        return seq  # a group of its own

    def push(self, seq: Sequence) -> None:
        seq.queued_at = self._clock()
        groups = self._groups.setdefault(seq.request.priority, {})
        groups.setdefault(self._key(seq), {})[seq] = None

    def push_front(self, seq: Sequence) -> None:
        self._front.insert(0, seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self._front:
            self._front.remove(seq)
            return
        prio = seq.request.priority
        key = self._key(seq)
        group = self._groups[prio][key]
        del group[seq]
        if not group:
            del self._groups[prio][key]
            if not self._groups[prio]:
                del self._groups[prio]

    def groups(self) -> Iterator[list[Sequence] | dict[Sequence, None]]:
        """Groups in admission order; do not mutate the queue while iterating.

        Per effective priority, most urgent first: its preempted sequences, then its groups
        (ties by priority, then arrival)."""
        if self._aging is None:
            prios = sorted({s.request.priority for s in self._front} | set(self._groups))
            for prio in prios:
                for seq in self._front:
                    if seq.request.priority == prio:
                        yield [seq]
                yield from self._groups.get(prio, {}).values()
            return
        yield from self._aged_groups(self._aging)

    def _aged_groups(self, aging: Aging) -> Iterator[list[Sequence] | dict[Sequence, None]]:
        now = self._clock()

        def level(seq: Sequence) -> int:
            return aging.effective(seq.request.priority, now - seq.queued_at)

        ranked: list[tuple[tuple[int, int, int, int], list[Sequence] | dict[Sequence, None]]]
        ranked = [((level(s), 0, s.request.priority, i), [s]) for i, s in enumerate(self._front)]
        for prio, groups in self._groups.items():
            for i, members in enumerate(groups.values()):
                oldest = next(iter(members))  # FIFO: the first waited longest
                ranked.append(((level(oldest), 1, prio, i), members))
        ranked.sort(key=lambda r: r[0])
        for _, group in ranked:
            yield group

    def count_new(self, priority: int) -> int:
        """New (never preempted) sequences waiting at `priority`."""
        return sum(len(g) for g in self._groups.get(priority, {}).values())

    def most_urgent_priority(self) -> int | None:
        return min(self._groups) if self._groups else None

    def __iter__(self) -> Iterator[Sequence]:
        for group in self.groups():
            yield from group
