"""The queue: claims and leases of requests, workers' heartbeats, fenced completion, release, and
idle workers' wake-ups.

`claim` leases requests to a worker (`lease_expires_at`); the worker renews its leases with
`heartbeat`; `complete` is fenced (a row is written only while it is still running and held by
the caller), so a worker whose lease expired and was re-claimed cannot overwrite anything.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Sequence

from sqlalchemy import and_, case, delete, func, or_, select, update

from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.records import ClaimedRequest, RequestResult
from batchmlx.store.base import StoreBase
from batchmlx.store.rows import CLAIMED_COLUMNS, QUEUED, RUNNING, B, R, W, claimed_request


class QueuePart(StoreBase):
    """The queue's operations of `Store`."""

    # -- wake-ups ----------------------------------------------------------------------------

    @property
    def listens(self) -> bool:
        """True when `wait_for_work` wakes on notifications rather than only sleeping."""
        return self._listener is not None

    async def wait_for_work(self, timeout: float) -> bool:
        """Sleep up to `timeout`; on PostgreSQL wake at once when work may have arrived
        (a batch started, requests released, a batch cancelled). True when woken early."""
        if self._listener is None:
            await asyncio.sleep(timeout)
            return False
        return await self._listener.wait(timeout)

    async def next_lease_end(
        self, models: Sequence[str] = (), default_model: str = "default"
    ) -> float | None:
        """When the first running lease of an in-progress batch ends (None: none runs): an idle
        worker wakes then to take over a dead worker's requests. `models`: only batches of
        these (a worker's --only-model; a batch naming none counts as `default_model`), so a
        worker never wakes for leases it would not take."""
        query = (
            select(func.min(R.c.lease_expires_at))
            .join(B, B.c.id == R.c.batch_id)
            .where(R.c.status == RUNNING, B.c.status == BatchStatus.IN_PROGRESS.value)
        )
        if models:
            mine = B.c.model.in_(list(models))
            query = query.where(or_(mine, B.c.model.is_(None)) if default_model in models
                                else mine)  # fmt: skip
        async with self._reader.connect() as conn:
            return (await conn.execute(query)).scalar()

    # -- leases ------------------------------------------------------------------------------

    async def claim(
        self,
        worker_id: str,
        limit: int,
        now: float,
        lease_s: float,
        batch_id: str | None = None,
    ) -> list[ClaimedRequest]:
        """Lease up to `limit` requests to `worker_id`: queued ones, or running ones whose lease
        expired (a dead worker's), from in-progress batches; the most urgent batch (lowest
        priority), then the oldest, first, then line order.
        """
        if limit <= 0:
            return []
        claimable = or_(
            R.c.status == QUEUED, and_(R.c.status == RUNNING, R.c.lease_expires_at < now)
        )
        pick = (
            select(R.c.id)
            .join(B, B.c.id == R.c.batch_id)
            .where(B.c.status == BatchStatus.IN_PROGRESS.value, claimable)
            .limit(limit)
        )
        if batch_id is not None:
            # line order alone: the (batch_id, line) index yields it, no sort of the whole batch
            pick = pick.where(R.c.batch_id == batch_id).order_by(R.c.line)
        else:
            # strict priorities here; the worker claims batch by batch in the aged order
            pick = pick.order_by(B.c.priority, B.c.created_at, self._sql.batch_seq, R.c.line)
        stmt = (
            update(R)
            .where(R.c.id.in_(self._sql.lock_claim(pick)))
            .values(
                status=RUNNING,
                worker_id=worker_id,
                lease_expires_at=now + lease_s,
                attempts=R.c.attempts + 1,
                claimed_at=now,
            )
            .returning(*CLAIMED_COLUMNS)
        )
        async with self._engine.begin() as conn:
            rows = (await conn.execute(stmt)).all()
            if not rows:
                return []
            batch_columns = (B.c.id, B.c.endpoint, B.c.model, B.c.created_at,
                             self._sql.batch_seq.label("seq"))  # fmt: skip
            batches = {
                b.id: b
                for b in await conn.execute(
                    select(*batch_columns).where(B.c.id.in_({r.batch_id for r in rows}))
                )
            }
        rows.sort(key=lambda r: (batches[r.batch_id].created_at, batches[r.batch_id].seq, r.line))
        return [claimed_request(r, batches[r.batch_id]) for r in rows]

    async def heartbeat(
        self,
        worker_id: str,
        now: float,
        lease_s: float,
        pid: int | None = None,
        hostname: str | None = None,
    ) -> int:
        """Extend every lease `worker_id` holds to now + lease_s and record that it is alive.

        Returns how many leases were renewed.
        """
        renew = (
            update(R)
            .where(R.c.worker_id == worker_id, R.c.status == RUNNING)
            .values(lease_expires_at=now + lease_s)
        )
        upsert = self._sql.insert(W).values(
            id=worker_id,
            pid=pid,
            hostname=hostname or socket.gethostname(),
            started_at=now,
            heartbeat_at=now,
        )
        upsert = upsert.on_conflict_do_update(
            index_elements=[W.c.id],
            set_={
                "heartbeat_at": upsert.excluded.heartbeat_at,
                "pid": func.coalesce(upsert.excluded.pid, W.c.pid),
                "hostname": upsert.excluded.hostname,
            },
        )
        async with self._engine.begin() as conn:
            renewed = (await conn.execute(renew)).rowcount
            await conn.execute(upsert)
            await self.sync_clock(conn)
        return renewed

    async def complete(
        self, worker_id: str, results: Sequence[tuple[int, RequestResult]], now: float
    ) -> int:
        """Record many results in one transaction; returns how many rows were written.

        Fenced: a row is written only while it is running and held by `worker_id`, so a late
        write from a worker whose lease expired (and was re-claimed or finished) changes nothing.
        """
        if not results:
            return 0
        async with self._engine.begin() as conn:
            return await self._sql.complete(conn, worker_id, results, now)

    async def release(self, worker_id: str, request_ids: Sequence[int] | None = None) -> int:
        """Put requests `worker_id` holds back in the queue (all of them when `request_ids` is
        None), e.g. on SIGTERM or preemption. Stopping is not failing: the claim's attempt is
        taken back, so `attempts` counts only runs that ended with the worker gone. Returns
        how many."""
        stmt = (
            update(R)
            .where(R.c.worker_id == worker_id, R.c.status == RUNNING)
            .values(
                status=QUEUED,
                worker_id=None,
                lease_expires_at=None,
                claimed_at=None,
                # not max(a, b): SQLite's two-argument max is no PostgreSQL function
                attempts=case((R.c.attempts > 0, R.c.attempts - 1), else_=0),
            )
        )
        if request_ids is not None:
            if not request_ids:
                return 0
            stmt = stmt.where(R.c.id.in_(list(request_ids)))
        async with self._engine.begin() as conn:
            n = (await conn.execute(stmt)).rowcount
            if n:
                await self._sql.notify(conn)
            return n

    # -- workers -----------------------------------------------------------------------------

    async def live_workers(self, now: float, within_s: float) -> list[str]:
        """Workers that sent a heartbeat in the last `within_s` seconds."""
        query = select(W.c.id).where(W.c.heartbeat_at >= now - within_s).order_by(W.c.id)
        async with self._reader.connect() as conn:
            return list((await conn.execute(query)).scalars())

    async def workers_on_host(self, hostname: str) -> list[tuple[str, int | None]]:
        """(worker id, pid) of every registered worker of `hostname`."""
        query = select(W.c.id, W.c.pid).where(W.c.hostname == hostname).order_by(W.c.id)
        async with self._reader.connect() as conn:
            return [(r.id, r.pid) for r in await conn.execute(query)]

    async def abandon_worker(self, worker_id: str) -> int:
        """A worker known dead (its process is gone): end its leases now, so its requests are
        claimed again at once rather than when the leases run out, and forget the worker.
        `attempts` stays counted: the run died. Returns how many leases ended."""
        stmt = (
            update(R)
            .where(R.c.worker_id == worker_id, R.c.status == RUNNING)
            .values(lease_expires_at=0.0)
        )
        async with self._engine.begin() as conn:
            n = (await conn.execute(stmt)).rowcount
            if n:
                await self._sql.notify(conn)
            await conn.execute(delete(W).where(W.c.id == worker_id))
        return n

    async def remove_worker(self, worker_id: str) -> None:
        async with self._engine.begin() as conn:
            await conn.execute(delete(W).where(W.c.id == worker_id))
