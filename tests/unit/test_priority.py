"""Priorities among batches and their aging (core/priority.py), with a fake clock."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from batchmlx.core.priority import (
    MAX_BATCH_PRIORITY,
    MIN_BATCH_PRIORITY,
    Aging,
    claim_order,
    engine_aging,
    engine_priority,
)
from batchmlx.core.request import BATCH_PRIORITY, GenerationRequest, SamplingParams
from batchmlx.core.sequence import Sequence
from batchmlx.core.waiting import WaitingQueue


@dataclass(frozen=True)
class Batch:
    id: str
    priority: int
    created_at: int


def test_aging_lowers_the_value_one_level_per_period_down_to_the_floor():
    aging = Aging(level_s=10.0)
    assert aging.effective(5, 0.0) == 5
    assert aging.effective(5, 9.9) == 5
    assert aging.effective(5, 10.0) == 4
    assert aging.effective(5, 35.0) == 2
    assert aging.effective(5, 1e9) == MIN_BATCH_PRIORITY
    assert Aging(level_s=0.0).effective(5, 1e9) == 5  # strict
    with pytest.raises(ValueError):
        Aging(level_s=-1.0)


def test_engine_priorities_keep_batch_order_behind_every_online_request():
    assert engine_priority(MIN_BATCH_PRIORITY) == BATCH_PRIORITY
    assert engine_priority(-1) < engine_priority(0) < engine_priority(MAX_BATCH_PRIORITY)
    with pytest.raises(ValueError):
        engine_priority(MAX_BATCH_PRIORITY + 1)
    # aged engine priorities never reach online ones (below BATCH_PRIORITY)
    assert engine_aging(1.0).effective(engine_priority(0), 1e9) == BATCH_PRIORITY


def test_claim_order_is_by_priority_then_age_and_aging_lets_an_old_batch_through():
    aging = Aging(level_s=60.0)
    old = Batch("old", priority=5, created_at=0)  # less urgent, first in
    new = Batch("new", priority=0, created_at=100)
    same = Batch("same", priority=0, created_at=200)
    given = [old, new, same]  # the store's order: oldest first
    assert [b.id for b in claim_order(given, 100.0, aging)] == ["new", "same", "old"]
    # 5 levels behind, 100 s older: at 20 s a level that is worth 5 levels, a tie, and the
    # tie keeps the given (oldest first) order; one level more and it is ahead alone
    assert [b.id for b in claim_order(given, 100.0, Aging(level_s=20.0))][0] == "old"
    assert [b.id for b in claim_order(given, 100.0, Aging(level_s=19.0))] == ["old", "new", "same"]
    assert [b.id for b in claim_order(given, 10_000.0, Aging(0.0))] == ["new", "same", "old"]


def _seq(rid: str, priority: int, arrival: int) -> Sequence:
    req = GenerationRequest(rid, [arrival + 1], SamplingParams(max_tokens=1), priority=priority)
    return Sequence(req, arrival=arrival)


def test_the_waiting_queue_ages_batch_work_but_never_past_online_requests():
    now = [0.0]
    queue = WaitingQueue(block_size=4, grouping=True, aging=engine_aging(10.0),
                         clock=lambda: now[0])  # fmt: skip
    low = _seq("low", engine_priority(3), 0)
    queue.push(low)
    now[0] = 35.0  # low has waited 3 levels' worth
    high = _seq("high", engine_priority(0), 1)
    queue.push(high)
    online = _seq("online", 0, 2)
    queue.push(online)
    # low 3 - 3 levels = high's 0: tied, the more urgent priority first
    assert [s.seq_id for s in queue] == ["online", "high", "low"]
    now[0] = 40.0  # low 4 levels, high none yet: low is ahead
    assert [s.seq_id for s in queue] == ["online", "low", "high"]
    now[0] = 1e9  # both at the floor: still behind the online request, FIFO among equals
    assert [s.seq_id for s in queue] == ["online", "high", "low"]


def test_aging_ranks_a_priority_by_its_longest_waiting_member_and_keeps_its_order():
    now = [0.0]
    queue = WaitingQueue(block_size=4, grouping=True, aging=engine_aging(10.0),
                         clock=lambda: now[0])  # fmt: skip
    old = [_seq(f"low{i}", engine_priority(2), i) for i in range(3)]
    for s in old:
        queue.push(s)
    now[0] = 25.0
    fresh = _seq("high", engine_priority(0), 3)
    queue.push(fresh)
    back = _seq("back", engine_priority(1), 4)  # preempted: first among its equals
    queue.push_front(back)
    # low: 2 - 2 levels = 0 ties high's 0 (the more urgent priority first); back: 1 - 0
    assert [s.seq_id for s in queue] == ["high", "low0", "low1", "low2", "back"]
    now[0] = 30.0  # low 3 levels: ahead, its members in their order
    assert [s.seq_id for s in queue] == ["low0", "low1", "low2", "high", "back"]
