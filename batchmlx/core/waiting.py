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

    With `aging`, a priority's new work rises a level for every `aging.level_s` seconds its
    longest-waiting member has waited (a preempted sequence by its own wait; core/priority.py),
    so a less urgent batch's lines are not overtaken forever by newer, more urgent ones; a
    priority's groups keep their order, and equal effective priorities keep the order above.
    Ranking is per priority, not per group: a step's admission pass stays cheap (a sort of
    the few priorities waiting, none when one is).
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
        seq.queued_at = self._clock()  # preempted: its wait starts again
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
        if not self._front and len(self._groups) == 1:  # one priority: nothing to rank
            yield from next(iter(self._groups.values())).values()
            return
        now = self._clock()
        # preempted sequences one by one, new ones a priority at a time (its groups in order)
        ranked: list[tuple[tuple[int, int, int, int], Sequence | int]] = [
            ((aging.effective(s.request.priority, now - s.queued_at), 0, s.request.priority, i), s)
            for i, s in enumerate(self._front)
        ]
        for prio, groups in self._groups.items():
            oldest = min(next(iter(g)).queued_at for g in groups.values())  # FIFO groups
            ranked.append(((aging.effective(prio, now - oldest), 1, prio, 0), prio))
        ranked.sort(key=lambda r: r[0])
        for _, item in ranked:
            if isinstance(item, Sequence):
                yield [item]
            else:
                yield from self._groups[item].values()

    def count_new(self, priority: int) -> int:
        """New (never preempted) sequences waiting at `priority`."""
        return sum(len(g) for g in self._groups.get(priority, {}).values())

    def most_urgent_priority(self) -> int | None:
        return min(self._groups) if self._groups else None

    def __iter__(self) -> Iterator[Sequence]:
        for group in self.groups():
            yield from group
