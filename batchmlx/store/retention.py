"""Retention: what leaves the database, and when. A finished batch's request bodies go with its
input file, its responses with its output file, its error objects with its error file (the rows
stay: the Batch object's counts and usage are summed from them); a purged batch goes whole
(requests, batch row, file records; the bytes are the caller's)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import and_, delete, func, or_, select, update

from batchmlx.core.lifecycle import TERMINAL_BATCH, BatchStatus
from batchmlx.core.records import FileRecord
from batchmlx.store.base import StoreBase
from batchmlx.store.batches import locked_status
from batchmlx.store.rows import DONE, SUCCEEDED, B, F, R, file_record

FINISHED = tuple(s.value for s in TERMINAL_BATCH)
# a dropped request body: valid JSON, as the column is NOT NULL and claims parse it
DROPPED_BODY = "{}"
# when a batch finished: the time its terminal status was entered
FINISHED_AT = func.coalesce(
    B.c.completed_at, B.c.failed_at, B.c.expired_at, B.c.cancelled_at, B.c.created_at
)
# the rows an output file is rendered from (the rest of the done ones go to the error file):
# the same split as BatchesPart.stream_results
_TO_OUTPUT = and_(R.c.status == SUCCEEDED, R.c.response_body.is_not(None))
_OF_ERRORS = and_(
    R.c.status.in_(DONE), ~_TO_OUTPUT, or_(R.c.response_body.is_not(None), R.c.error.is_not(None))
)


@dataclass(frozen=True, slots=True)
class FinishedBatch:
    id: str
    status: BatchStatus
    finished_at: int


@dataclass(frozen=True, slots=True)
class PurgedBatch:
    """A batch removed from the database: its requests counted, its file records returned so
    their bytes can be deleted too."""

    id: str
    status: BatchStatus
    finished_at: int
    requests: int
    files: tuple[FileRecord, ...]


def _gone(file_id: Any) -> Any:
    """The batch names this file, and the file is no longer recorded (deleted, expired)."""
    return and_(file_id.is_not(None), ~select(F.c.id).where(F.c.id == file_id).exists())


def _holds(*where: Any) -> Any:
    return select(R.c.id).where(R.c.batch_id == B.c.id, *where).exists()


class RetentionPart(StoreBase):
    """The retention operations of `Store`."""

    async def orphaned_contents(self, *, file_ids: Sequence[str] | None = None) -> list[str]:
        """Finished batches whose file is gone while the rows it came from (or went to) still
        hold their contents; with `file_ids`, only batches naming one of those files. A read:
        the write lock is taken by `forget_contents`, for these batches only."""
        query = select(B.c.id).where(
            B.c.status.in_(FINISHED),
            or_(
                and_(_gone(B.c.input_file_id), _holds(R.c.body != DROPPED_BODY)),
                and_(_gone(B.c.output_file_id), _holds(_TO_OUTPUT)),
                and_(_gone(B.c.error_file_id), _holds(_OF_ERRORS)),
            ),
        )
        if file_ids is not None:
            ids = list(file_ids)
            query = query.where(or_(B.c.input_file_id.in_(ids), B.c.output_file_id.in_(ids),
                                    B.c.error_file_id.in_(ids)))  # fmt: skip
        async with self._reader.connect() as conn:
            return list((await conn.execute(query)).scalars())

    async def forget_contents(self, batch_ids: Sequence[str]) -> int:
        """Drop, for these finished batches, the request bodies whose input file is gone, the
        responses whose output file is gone, the error objects whose error file is gone; the
        rows' status and token counts stay. Returns the rows changed."""
        if not batch_ids:
            return 0

        def of(file_id: Any) -> Any:
            gone = select(B.c.id).where(B.c.id.in_(list(batch_ids)), B.c.status.in_(FINISHED),
                                        _gone(file_id))  # fmt: skip
            return R.c.batch_id.in_(gone)

        statements = (
            update(R).where(of(B.c.input_file_id), R.c.body != DROPPED_BODY)
            .values(body=DROPPED_BODY),
            update(R).where(of(B.c.output_file_id), _TO_OUTPUT).values(response_body=None),
            update(R).where(of(B.c.error_file_id), _OF_ERRORS)
            .values(response_body=None, error=None),
        )  # fmt: skip
        changed = 0
        async with self._engine.begin() as conn:
            for stmt in statements:
                changed += (await conn.execute(stmt)).rowcount
        return changed

    async def finished_before(self, cutoff: float, *, limit: int = 500) -> list[FinishedBatch]:
        """Finished batches (completed, failed, expired, cancelled) that finished before
        `cutoff` (unix seconds), oldest first."""
        query = (
            select(B.c.id, B.c.status, FINISHED_AT)
            .where(B.c.status.in_(FINISHED), FINISHED_AT < cutoff)
            .order_by(FINISHED_AT, B.c.id)
            .limit(limit)
        )
        async with self._reader.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [FinishedBatch(r[0], BatchStatus(r[1]), int(r[2])) for r in rows]

    async def purge_batch(self, batch_id: str) -> PurgedBatch | None:
        """Remove a finished batch: its requests, its row, and the records of its files (an
        input file another batch still names is kept). One transaction, the batch's row locked
        (two hosts purging at once take turns); None when it is gone or not finished. The
        returned files' bytes are the caller's to delete."""
        async with self._engine.begin() as conn:
            try:
                status = BatchStatus(await locked_status(conn, batch_id))
            except KeyError:
                return None
            if not status.terminal:
                return None
            row = (await conn.execute(
                select(B.c.input_file_id, B.c.output_file_id, B.c.error_file_id, FINISHED_AT)
                .where(B.c.id == batch_id))).one()  # fmt: skip
            input_id, output_id, error_id, finished_at = row
            shared = (await conn.execute(select(func.count()).where(
                B.c.input_file_id == input_id, B.c.id != batch_id))).scalar_one()  # fmt: skip
            file_ids = [f for f in (None if shared else input_id, output_id, error_id) if f]
            files = [file_record(m) for m in (await conn.execute(
                select(F).where(F.c.id.in_(file_ids)))).mappings()]  # fmt: skip
            requests = (await conn.execute(delete(R).where(R.c.batch_id == batch_id))).rowcount
            await conn.execute(delete(B).where(B.c.id == batch_id))
            await conn.execute(delete(F).where(F.c.id.in_([f.id for f in files])))
        return PurgedBatch(batch_id, status, int(finished_at), requests, tuple(files))
