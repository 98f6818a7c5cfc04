"""Batches: their records, status moves (checked against the lifecycle table), queue depth, the
per-batch lock of finalize, and the results of their done requests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable
from typing import Any

from sqlalchemy import and_, func, insert, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from batchmlx.core.lifecycle import BatchStatus, RequestStatus, check_transition
from batchmlx.core.records import BatchRecord, RequestResult
from batchmlx.store.base import StoreBase, rows_after
from batchmlx.store.rows import (
    BATCH_REF_COLUMNS,
    DONE,
    NOT_DONE,
    PROGRESS_COLUMNS,
    SUCCEEDED,
    B,
    R,
    batch_record,
    batch_ref,
    batch_values,
    dumps,
    errors_json,
    loads,
    result_row,
    result_values,
)
from batchmlx.store.types import BatchRef, ResultRow

# The timestamp column each status sets when a batch enters it.
_STATUS_AT: dict[BatchStatus, str] = {
    BatchStatus.IN_PROGRESS: "in_progress_at",
    BatchStatus.FINALIZING: "finalizing_at",
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.FAILED: "failed_at",
    BatchStatus.EXPIRED: "expired_at",
    BatchStatus.CANCELLING: "cancelling_at",
    BatchStatus.CANCELLED: "cancelled_at",
}
# Fields set_batch_status may change besides status and its *_at.
_SETTABLE = frozenset(
    {"endpoint", "model", "expires_at", "output_file_id", "error_file_id", "errors"}
)


async def locked_status(conn: AsyncConnection, batch_id: str) -> str:
    """The batch's status, its row locked until the transaction ends (KeyError: unknown).
    FOR UPDATE: two hosts moving one batch at once take turns (SQLite: BEGIN IMMEDIATE)."""
    query = select(B.c.status).where(B.c.id == batch_id).with_for_update()
    current = (await conn.execute(query)).scalar()
    if current is None:
        raise KeyError(batch_id)
    return current


async def read_batch(conn: AsyncConnection, batch_id: str) -> BatchRecord | None:
    """The batch with live request counts and token usage summed from its requests."""
    row = (await conn.execute(select(B).where(B.c.id == batch_id))).mappings().first()
    if row is None:
        return None
    progress = (
        await conn.execute(select(*PROGRESS_COLUMNS).where(R.c.batch_id == batch_id))
    ).first()
    return batch_record(row, progress)


class BatchesPart(StoreBase):
    """The batch operations of `Store`."""

    async def create_batch(
        self,
        rec: BatchRecord,
        *,
        content_hash: str | None = None,
        source: str | None = None,
    ) -> None:
        """Store a batch without requests: `start_validated_batch` is what enqueues them."""
        values = batch_values(rec, content_hash=content_hash, source=source)
        async with self._engine.begin() as conn:
            await conn.execute(insert(B).values(**values))

    async def get_batch(self, batch_id: str) -> BatchRecord | None:
        """The batch with live request counts and token usage summed from its requests."""
        async with self._reader.connect() as conn:
            return await read_batch(conn, batch_id)

    async def list_batches(self, limit: int = 20, after: str | None = None) -> list[BatchRecord]:
        """Newest first; `after` is the id of the last batch of the previous page."""
        seq = self._sql.batch_seq
        query = select(B).order_by(B.c.created_at.desc(), seq.desc()).limit(limit)
        async with self._reader.connect() as conn:
            if after is not None:
                beyond = await rows_after(conn, B, seq, after, desc=True)
                if beyond is None:
                    return []
                query = query.where(beyond)
            rows = (await conn.execute(query)).mappings().all()
            ids = [r["id"] for r in rows]
            progress = {
                p[0]: p[1:]
                for p in await conn.execute(
                    select(R.c.batch_id, *PROGRESS_COLUMNS)
                    .where(R.c.batch_id.in_(ids))
                    .group_by(R.c.batch_id)
                )
            }
        return [batch_record(r, progress.get(r["id"])) for r in rows]

    async def batch_source(self, batch_id: str) -> str | None:
        """Where the batch came from: "cli", "inbox:/dir/name.jsonl", … (None if unknown)."""
        async with self._reader.connect() as conn:
            return (await conn.execute(select(B.c.source).where(B.c.id == batch_id))).scalar()

    async def find_batch_by_hash(
        self, content_hash: str, statuses: Iterable[BatchStatus] | None = None
    ) -> BatchRecord | None:
        """The newest batch made from a file with this content hash (in one of `statuses`)."""
        where = [B.c.content_hash == content_hash]
        if statuses is not None:
            where.append(B.c.status.in_([s.value for s in statuses]))
        return await self._newest_batch(*where)

    async def find_batch_by_source(self, source: str) -> BatchRecord | None:
        """The newest batch whose `source` is exactly this (an inbox drop, say)."""
        return await self._newest_batch(B.c.source == source)

    async def _newest_batch(self, *where: Any) -> BatchRecord | None:
        newest = (B.c.created_at.desc(), self._sql.batch_seq.desc())
        async with self._reader.connect() as conn:
            batch_id = (
                await conn.execute(select(B.c.id).where(*where).order_by(*newest).limit(1))
            ).scalar()
            return None if batch_id is None else await read_batch(conn, batch_id)

    async def set_batch_status(
        self, batch_id: str, status: BatchStatus, now: float, **fields: Any
    ) -> BatchRecord:
        """Move a batch to `status` (checked against the lifecycle table) and stamp its *_at.

        `fields` may set model, expires_at, output_file_id, error_file_id and errors (a sequence
        of BatchErrorRecord). Raises KeyError for an unknown batch, TransitionError for a move
        the lifecycle forbids.
        """
        unknown = set(fields) - _SETTABLE
        if unknown:
            raise TypeError(f"set_batch_status cannot set {sorted(unknown)}")
        values: dict[str, Any] = dict(fields, status=status.value)
        if "errors" in values:
            values["errors"] = errors_json(values["errors"])
        if status in _STATUS_AT:
            values[_STATUS_AT[status]] = int(now)
        async with self._engine.begin() as conn:
            current = await locked_status(conn, batch_id)
            check_transition(BatchStatus(current), status)
            await conn.execute(update(B).where(B.c.id == batch_id).values(**values))
            if status in (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING):
                await self._sql.notify(conn)
            record = await read_batch(conn, batch_id)
        assert record is not None
        return record

    async def update_batch_stats(self, batch_id: str, stats: dict[str, Any]) -> None:
        """Merge `stats` into the batch's stats object (top-level keys replace)."""
        async with self._engine.begin() as conn:
            current = (await conn.execute(select(B.c.stats).where(B.c.id == batch_id))).first()
            if current is None:
                raise KeyError(batch_id)
            merged = {**(loads(current[0]) or {}), **stats}
            await conn.execute(update(B).where(B.c.id == batch_id).values(stats=dumps(merged)))

    async def batches_with_status(self, *statuses: BatchStatus) -> list[BatchRef]:
        """Batches in any of `statuses`, oldest first (claim order); no request counts."""
        query = (
            select(*BATCH_REF_COLUMNS)
            .where(B.c.status.in_([s.value for s in statuses]))
            .order_by(B.c.created_at, self._sql.batch_seq)
        )
        async with self._reader.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [batch_ref(r) for r in rows]

    async def active_batches(self) -> list[BatchRef]:
        """In-progress batches, oldest first: those `claim` takes requests from."""
        return await self.batches_with_status(BatchStatus.IN_PROGRESS)

    async def status_counts(self) -> tuple[dict[BatchStatus, int], dict[RequestStatus, int]]:
        """Batches and requests by status, every status present (0 where none): queue depth."""
        async with self._reader.connect() as conn:
            batches = dict((await conn.execute(
                select(B.c.status, func.count()).group_by(B.c.status))).all())  # fmt: skip
            requests = dict((await conn.execute(
                select(R.c.status, func.count()).group_by(R.c.status))).all())  # fmt: skip
        return (
            {s: batches.get(s.value, 0) for s in BatchStatus},
            {s: requests.get(s.value, 0) for s in RequestStatus},
        )

    async def batches_to_finalize(self) -> list[str]:
        """Batches to finalize, oldest first: in-progress ones whose every request is done
        (succeeded or failed), and finalizing ones a crash left half-finalized."""
        pending = select(R.c.id).where(R.c.batch_id == B.c.id, R.c.status.in_(NOT_DONE))
        ready = and_(B.c.status == BatchStatus.IN_PROGRESS.value, ~pending.exists())
        query = (
            select(B.c.id)
            .where(or_(ready, B.c.status == BatchStatus.FINALIZING.value))
            .order_by(B.c.created_at, self._sql.batch_seq)
        )
        async with self._reader.connect() as conn:
            return list((await conn.execute(query)).scalars())

    @contextlib.asynccontextmanager
    async def batch_lock(self, batch_id: str) -> AsyncIterator[bool]:
        """Try to become the one process working on `batch_id` (finalize): yields True when
        this process holds it. On PostgreSQL a session advisory lock, so a host that dies
        lets go with its connection; on SQLite (one host) an `flock` on a file beside the
        database, which a process that dies lets go of too (see dialects.py)."""

        async def finished() -> bool:
            async with self._reader.connect() as conn:
                status = (await conn.execute(select(B.c.status).where(B.c.id == batch_id))).scalar()
            return status is None or BatchStatus(status).terminal

        async with self._sql.batch_lock(self._engine, batch_id, finished) as held:
            yield held

    # -- results -----------------------------------------------------------------------------

    async def iter_results(self, batch_id: str) -> list[ResultRow]:
        """The batch's done requests in input line order (all at once: small batches)."""
        return [r async for r in self.stream_results(batch_id)]

    async def stream_results(
        self, batch_id: str, *, output: bool | None = None, per: int = 256
    ) -> AsyncIterator[ResultRow]:
        """The batch's done requests in input line order, `per` rows in memory at a time.
        `output` True: only those of the output file (succeeded, with a body); False: only
        those of the error file; None: all."""
        query = select(R).where(R.c.batch_id == batch_id, R.c.status.in_(DONE))
        # the output file's lines: what formats.output renders there (a success with a body)
        to_output = and_(R.c.status == SUCCEEDED, R.c.response_body.is_not(None))
        if output is not None:
            query = query.where(to_output if output else ~to_output)
        query = query.order_by(R.c.line).execution_options(yield_per=per)
        # one read transaction: a snapshot of the rows, however long the caller takes
        async with self._reader.connect() as conn:
            result = await conn.stream(query)
            async for m in result.mappings():
                yield result_row(m)

    async def has_error_code(self, batch_id: str, code: str) -> bool:
        """Whether a done request of the batch carries an error object with this `code`."""
        query = (
            select(R.c.error)
            .where(R.c.batch_id == batch_id, R.c.status.in_(DONE), R.c.error.contains(code))
            .execution_options(yield_per=256)
        )
        async with self._reader.connect() as conn:
            result = await conn.stream(query)
            async for (error,) in result:
                if (loads(error) or {}).get("code") == code:
                    return True
        return False

    async def finish_unfinished(self, batch_id: str, result: RequestResult, now: float) -> int:
        """Give every not-done request of the batch `result` (cancel, expiry); returns how many.

        Not fenced: a worker still holding one of these rows will find its `complete` ignored.
        """
        stmt = (
            update(R)
            .where(R.c.batch_id == batch_id, R.c.status.in_(NOT_DONE))
            .values(**result_values(result, now))
        )
        async with self._engine.begin() as conn:
            return (await conn.execute(stmt)).rowcount
