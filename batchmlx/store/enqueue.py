"""Enqueueing: the one place request rows are written, in the transaction that starts their batch
(validating → in_progress), so nothing is visible, or kept, before the batch starts."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.ext.asyncio import AsyncConnection

from batchmlx.core.lifecycle import BatchStatus, check_transition
from batchmlx.store.base import StoreBase
from batchmlx.store.batches import locked_status
from batchmlx.store.dialects import DialectSQL
from batchmlx.store.rows import B, R, request_values
from batchmlx.store.types import NewRequest


class EnqueuePart(StoreBase):
    """The enqueue operations of `Store`."""

    async def start_validated_batch(
        self,
        batch_id: str,
        requests: Sequence[NewRequest],
        now: float,
        *,
        model: str | None,
        endpoint: str | None = None,
        content_hash: str | None = None,
    ) -> bool:
        """validating → in_progress with its requests enqueued, in one transaction. False (and
        nothing written) when the batch is no longer validating: another process got there."""
        async with self.enqueue(batch_id) as q:
            if q is None:
                return False
            await q.add(requests)
            return await q.start(now, model=model, endpoint=endpoint, content_hash=content_hash)

    @contextlib.asynccontextmanager
    async def enqueue(self, batch_id: str) -> AsyncIterator[Enqueue | None]:
        """One transaction that writes a validating batch's requests as they come (`add`, any
        number of times) and then starts it (`start`): the one place request rows are written.
        Nothing is visible before it commits, and nothing is kept unless `start` was called
        (a file that fails validation half-way, an exception, a crash). Yields None when the
        batch is no longer validating. Two callers take turns (the batch row is locked)."""
        async with self._engine.connect() as conn:
            tx = await conn.begin()
            try:
                current = await locked_status(conn, batch_id)
                if current != BatchStatus.VALIDATING.value:
                    await tx.rollback()
                    yield None
                    return
                q = Enqueue(self._sql, conn, batch_id)
                yield q
                if q.started:
                    await tx.commit()
                else:
                    await tx.rollback()
            except BaseException:
                if tx.is_active:
                    await tx.rollback()
                raise


class Enqueue:
    """A validating batch's requests on their way in (see `Store.enqueue`)."""

    def __init__(self, sql: DialectSQL, conn: AsyncConnection, batch_id: str) -> None:
        self._sql, self._conn, self.batch_id = sql, conn, batch_id
        self.added = 0  # request rows written so far
        self.started = False

    async def add(self, requests: Sequence[NewRequest]) -> None:
        if not requests:
            return
        rows = [request_values(self.batch_id, r) for r in requests]
        await self._conn.execute(insert(R), rows)  # executemany: one prepared statement
        self.added += len(rows)

    async def start(
        self,
        now: float,
        *,
        model: str | None,
        endpoint: str | None = None,
        content_hash: str | None = None,
    ) -> bool:
        """validating → in_progress, committed with the requests when the block ends."""
        check_transition(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
        values: dict[str, Any] = {
            "status": BatchStatus.IN_PROGRESS.value,
            "in_progress_at": int(now),
            "model": model,
        }
        if endpoint is not None:
            values["endpoint"] = endpoint
        if content_hash is not None:
            values["content_hash"] = content_hash
        move = (
            update(B)
            .where(B.c.id == self.batch_id, B.c.status == BatchStatus.VALIDATING.value)
            .values(**values)
        )
        if (await self._conn.execute(move)).rowcount != 1:
            return False
        if self.added:
            await self._sql.notify(self._conn)
        self.started = True
        return True
