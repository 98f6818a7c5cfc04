"""The scheduler's waiting queue: preempted sequences first, then new ones by priority and
prefix group."""

from __future__ import annotations

from collections.abc import Iterator

from batchmlx.core.sequence import Sequence


class WaitingQueue:
    """Waiting sequences in admission order.

    Preempted sequences come first (the earliest admitted first). New arrivals follow by
    priority (online requests before batch work), and within a priority in groups keyed by
    their first full block, so requests sharing a system prompt sit together; groups keep the
    FIFO order of their first member, and members keep FIFO order within a group.
    """

    def __init__(self, block_size: int, grouping: bool) -> None:
        self._block_size = block_size
        self._grouping = grouping
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

        Per priority, most urgent first: its preempted sequences, then its groups."""
        prios = sorted({s.request.priority for s in self._front} | set(self._groups))
        for prio in prios:
            for seq in self._front:
                if seq.request.priority == prio:
                    yield [seq]
            yield from self._groups.get(prio, {}).values()

    def count_new(self, priority: int) -> int:
        """New (never preempted) sequences waiting at `priority`."""
        return sum(len(g) for g in self._groups.get(priority, {}).values())

    def most_urgent_priority(self) -> int | None:
        return min(self._groups) if self._groups else None

    def __iter__(self) -> Iterator[Sequence]:
        for group in self.groups():
            yield from group
