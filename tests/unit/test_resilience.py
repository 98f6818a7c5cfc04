"""The worker's fault rules: which faults are transient, the backoff between retries, and the
server's supervisor (fake workers: this is about restarts and answers, not engines)."""

from __future__ import annotations

import asyncio
import errno
import sqlite3

import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

from batchmlx.server.supervisor import MAX_RESTARTS, WORKER_STOPPED, Supervisor
from batchmlx.worker.online import DoneEvent, OnlineQueue
from batchmlx.worker.resilience import Backoff, is_transient


def test_backoff_doubles_to_its_cap_and_resets() -> None:
    b = Backoff(first=0.5, cap=3.0)
    assert [b.next() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    b.reset()
    assert b.next() == 0.5


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (OperationalError("UPDATE", {}, sqlite3.OperationalError("database is locked")), True),
        (
            OperationalError("UPDATE", {}, sqlite3.OperationalError("database or disk is full")),
            True,
        ),
        (OperationalError("UPDATE", {}, sqlite3.OperationalError("no such table: x")), False),
        (IntegrityError("INSERT", {}, sqlite3.IntegrityError("UNIQUE constraint")), False),
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EIO, "Input/output error"), True),
        (FileExistsError(errno.EEXIST, "File exists"), False),  # a batch's own path problem
        (OverflowError("int too big"), False),
    ],
)
def test_which_faults_are_transient(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


class _FakeWorker:
    """Stops by itself (raises) `dies` times in a row across instances, else runs until told."""

    def __init__(self, plan: list[bool]) -> None:
        self.plan = plan
        self.online = OnlineQueue()
        self.stop_requested = False

    async def run(self) -> None:
        if self.plan.pop(0):
            raise RuntimeError("boom")
        while not self.stop_requested:
            await asyncio.sleep(0.001)


def test_supervisor_restarts_and_answers_waiting_tickets() -> None:
    async def main() -> None:
        plan = [True, False]  # the first worker dies, the second runs
        first = _FakeWorker(plan)
        ticket = first.online.submit("/v1/chat/completions", {})
        first.online.drain()  # running in the engine when the worker dies
        sup = Supervisor(first, lambda: _FakeWorker(plan), first_delay=0.001)
        task = asyncio.create_task(sup.run())
        event = await asyncio.wait_for(ticket.events.get(), 10)
        assert event == DoneEvent(503, WORKER_STOPPED)
        while sup.worker is first:
            await asyncio.sleep(0.001)
        assert sup.worker.online is first.online  # tickets sent meanwhile reach the new one
        sup.stop()
        await asyncio.wait_for(task, 10)
        assert not sup.failed

    asyncio.run(main())


def test_supervisor_gives_up_after_max_restarts() -> None:
    async def main() -> None:
        plan = [True] * (MAX_RESTARTS + 1)
        gave_up: list[bool] = []
        sup = Supervisor(_FakeWorker(plan), lambda: _FakeWorker(plan),
                         on_give_up=lambda: gave_up.append(True), first_delay=0.001)  # fmt: skip
        await asyncio.wait_for(sup.run(), 30)
        assert sup.failed and gave_up == [True] and plan == []

    asyncio.run(main())
