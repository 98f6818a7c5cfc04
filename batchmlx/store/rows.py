"""Rows ↔ records, written once: what a table row becomes (BatchRecord, FileRecord, ResultRow,
ClaimedRequest, BatchRef) and what a record is written as. JSON columns are TEXT (orjson)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from sqlalchemy import case, func

from batchmlx.core.lifecycle import BatchStatus, RequestStatus
from batchmlx.core.priority import DEFAULT_BATCH_PRIORITY
from batchmlx.core.records import (
    BatchErrorRecord,
    BatchRecord,
    BatchUsage,
    CacheOutcomes,
    ClaimedRequest,
    FileRecord,
    RequestCounts,
    RequestResult,
)
from batchmlx.store.models import BATCHES, FILES, REQUESTS, WORKERS
from batchmlx.store.types import BatchRef, NewRequest, ResultRow

B, R, F, W = BATCHES, REQUESTS, FILES, WORKERS

QUEUED = RequestStatus.QUEUED.value
RUNNING = RequestStatus.RUNNING.value
SUCCEEDED = RequestStatus.SUCCEEDED.value
FAILED = RequestStatus.FAILED.value
DONE = (SUCCEEDED, FAILED)
NOT_DONE = (QUEUED, RUNNING)


def dumps(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


def loads(text: str | None) -> Any:
    return None if text is None else orjson.loads(text)


def errors_json(errors: Iterable[BatchErrorRecord]) -> str | None:
    return dumps(
        [{"code": e.code, "message": e.message, "line": e.line, "param": e.param} for e in errors]
    )


# -- records as rows -----------------------------------------------------------------------------


def file_values(rec: FileRecord) -> dict[str, Any]:
    return {
        "id": rec.id,
        "filename": rec.filename,
        "purpose": rec.purpose,
        "bytes": rec.bytes,
        "created_at": rec.created_at,
        "path": rec.path,
        "expires_at": rec.expires_at,
    }


def batch_values(
    rec: BatchRecord, *, content_hash: str | None, source: str | None
) -> dict[str, Any]:
    """A new batch's row; its finalizing_at … cancelled_at are set by status moves only."""
    return {
        "id": rec.id,
        "endpoint": rec.endpoint,
        "model": rec.model,
        "input_file_id": rec.input_file_id,
        "completion_window": rec.completion_window,
        "status": rec.status.value,
        "created_at": rec.created_at,
        "expires_at": rec.expires_at,
        "in_progress_at": rec.in_progress_at,
        "failed_at": rec.failed_at,
        "output_file_id": rec.output_file_id,
        "error_file_id": rec.error_file_id,
        "errors": errors_json(rec.errors) if rec.errors else None,
        "metadata": dumps(rec.metadata),
        "content_hash": content_hash,
        "source": source,
        "stats": dumps(rec.stats or {}),
        "output_expires_after": rec.output_expires_after,
        "priority": rec.priority,
    }


def request_values(batch_id: str, r: NewRequest) -> dict[str, Any]:
    """A queued request's row."""
    body = r.body if isinstance(r.body, str) else orjson.dumps(r.body).decode()
    return {"batch_id": batch_id, "line": r.line, "custom_id": r.custom_id, "body": body,
            "status": QUEUED}  # fmt: skip


def result_values(result: RequestResult, now: float) -> dict[str, Any]:
    """The columns a request's result sets (complete, finish_unfinished)."""
    return {
        "status": result.status.value,
        "status_code": result.status_code,
        "response_body": dumps(result.body),
        "error": dumps(result.error),
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "completion_tokens": result.completion_tokens,
        "cache_outcome": result.cache_outcome,
        "finished_at": now,
        "lease_expires_at": None,
    }


# The per-row fields of result_values (PostgreSQL's complete sends them as arrays); finished_at
# and lease_expires_at are the same for every row of one call.
PER_ROW = ("status", "status_code", "response_body", "error", "prompt_tokens", "cached_tokens",
           "completion_tokens", "cache_outcome")  # fmt: skip
SAME_FOR_ALL = frozenset({"finished_at", "lease_expires_at"})


# -- rows as records -----------------------------------------------------------------------------


def _done_sum(col: Any) -> Any:
    return func.coalesce(func.sum(case((R.c.status.in_(DONE), col), else_=0)), 0)


def _done_outcome(outcome: str) -> Any:
    return _done_sum(case((R.c.cache_outcome == outcome, 1), else_=0))


# Per batch: total, succeeded, failed, token sums and prefix-cache outcomes over done requests,
# the first claim still on record (when work on the batch started) and the last result.
PROGRESS_COLUMNS = (
    func.count(R.c.id),
    func.coalesce(func.sum(case((R.c.status == SUCCEEDED, 1), else_=0)), 0),
    func.coalesce(func.sum(case((R.c.status == FAILED, 1), else_=0)), 0),
    _done_sum(R.c.prompt_tokens),
    _done_sum(R.c.cached_tokens),
    _done_sum(R.c.completion_tokens),
    _done_outcome("HIT"),
    _done_outcome("PREFIX_HIT"),
    _done_outcome("MISS"),
    func.min(R.c.claimed_at),
    func.max(R.c.finished_at),
)


@dataclass(frozen=True, slots=True)
class _Progress:
    counts: RequestCounts = RequestCounts()
    usage: BatchUsage = BatchUsage()
    outcomes: CacheOutcomes = CacheOutcomes()
    started_at: float | None = None
    ended_at: float | None = None


def _progress(row: Sequence[Any] | None) -> _Progress:
    if row is None:
        return _Progress()
    total, ok, failed, prompt, cached, completion, hits, prefix_hits, misses, *span = row
    return _Progress(
        RequestCounts(total=total, completed=ok, failed=failed),
        BatchUsage(input_tokens=prompt, cached_tokens=cached, output_tokens=completion),
        CacheOutcomes(hits=hits, prefix_hits=prefix_hits, misses=misses),
        *span,
    )


def batch_record(m: Mapping[str, Any], progress: Sequence[Any] | None) -> BatchRecord:
    """A batches row with its PROGRESS_COLUMNS (None: no requests)."""
    p = _progress(progress)
    return BatchRecord(
        id=m["id"],
        endpoint=m["endpoint"],
        model=m["model"],
        input_file_id=m["input_file_id"],
        completion_window=m["completion_window"],
        status=BatchStatus(m["status"]),
        created_at=m["created_at"],
        expires_at=m["expires_at"],
        in_progress_at=m["in_progress_at"],
        finalizing_at=m["finalizing_at"],
        completed_at=m["completed_at"],
        failed_at=m["failed_at"],
        expired_at=m["expired_at"],
        cancelling_at=m["cancelling_at"],
        cancelled_at=m["cancelled_at"],
        output_file_id=m["output_file_id"],
        error_file_id=m["error_file_id"],
        errors=tuple(BatchErrorRecord(**e) for e in loads(m["errors"]) or ()),
        request_counts=p.counts,
        usage=p.usage,
        metadata=loads(m["metadata"]),
        stats=loads(m["stats"]) or {},
        output_expires_after=m.get("output_expires_after"),
        priority=m.get("priority") or DEFAULT_BATCH_PRIORITY,
        outcomes=p.outcomes,
        work_started_at=p.started_at,
        work_ended_at=p.ended_at,
    )


# The columns batch_ref reads.
BATCH_REF_COLUMNS = (
    B.c.id, B.c.status, B.c.endpoint, B.c.model, B.c.created_at, B.c.expires_at, B.c.priority,
)  # fmt: skip


def batch_ref(r: Any) -> BatchRef:
    return BatchRef(
        r.id, BatchStatus(r.status), r.endpoint, r.model, r.created_at, r.expires_at, r.priority
    )


def file_record(m: Mapping[str, Any]) -> FileRecord:
    return FileRecord(
        id=m["id"],
        filename=m["filename"],
        purpose=m["purpose"],
        bytes=m["bytes"],
        created_at=m["created_at"],
        path=m["path"],
        expires_at=m.get("expires_at"),
    )


def result_row(m: Mapping[str, Any]) -> ResultRow:
    return ResultRow(
        id=m["id"],
        custom_id=m["custom_id"],
        line=m["line"],
        status=RequestStatus(m["status"]),
        status_code=m["status_code"],
        response_body=loads(m["response_body"]),
        error=loads(m["error"]),
        prompt_tokens=m["prompt_tokens"],
        cached_tokens=m["cached_tokens"],
        completion_tokens=m["completion_tokens"],
        cache_outcome=m["cache_outcome"],
        attempts=m["attempts"],
        finished_at=m["finished_at"],
    )


# The columns claimed_request reads of the request (RETURNING) and of its batch.
CLAIMED_COLUMNS = (R.c.id, R.c.batch_id, R.c.custom_id, R.c.line, R.c.body, R.c.attempts)


def claimed_request(r: Any, batch: Any) -> ClaimedRequest:
    return ClaimedRequest(
        id=r.id,
        batch_id=r.batch_id,
        custom_id=r.custom_id,
        line=r.line,
        endpoint=batch.endpoint,
        model=batch.model,
        body=orjson.loads(r.body),
        attempts=r.attempts,
    )
