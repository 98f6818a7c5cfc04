"""Frozen records that cross layer boundaries: what the store returns and the formats render."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchmlx.core.lifecycle import BatchStatus, RequestStatus
from batchmlx.core.request import BATCH_PRIORITY


@dataclass(frozen=True, slots=True)
class BatchErrorRecord:
    """One validation error of a batch file (OpenAI's `errors.data[]` item)."""

    code: str
    message: str
    line: int | None = None  # 1-based input line, counting every line of the file
    param: str | None = None


@dataclass(frozen=True, slots=True)
class RequestCounts:
    total: int = 0
    completed: int = 0  # succeeded
    failed: int = 0


@dataclass(frozen=True, slots=True)
class BatchUsage:
    input_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    output_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class CacheOutcomes:
    """How the done requests' prompts met the prefix cache at their first admission, counted
    live from the requests (a running or cancelling batch has them too, not only a finalized
    one's stats)."""

    hits: int = 0
    prefix_hits: int = 0
    misses: int = 0

    @property
    def total(self) -> int:
        return self.hits + self.prefix_hits + self.misses

    @property
    def hit_rate(self) -> float | None:
        """Share of requests that reused a cached prefix (None: no request has one yet)."""
        return (self.hits + self.prefix_hits) / self.total if self.total else None


@dataclass(frozen=True, slots=True)
class BatchRecord:
    id: str  # "batch_…"
    endpoint: str  # "/v1/chat/completions" or "/v1/completions"
    model: str | None  # the model that serves (or will serve) the batch
    input_file_id: str  # "file-…"
    completion_window: str  # "24h"
    status: BatchStatus
    created_at: int  # unix seconds, like every *_at
    expires_at: int | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: tuple[BatchErrorRecord, ...] = ()
    request_counts: RequestCounts = field(default_factory=RequestCounts)
    usage: BatchUsage = field(default_factory=BatchUsage)
    metadata: dict[str, str] | None = None
    # batchmlx's own figures, shown by `status ID`, not part of the OpenAI object
    stats: dict[str, Any] = field(default_factory=dict)
    output_expires_after: int | None = None  # seconds: output/error files expire this long after
    # they are written (None: never)
    outcomes: CacheOutcomes = field(default_factory=CacheOutcomes)
    priority: int = 0  # lower is claimed first (core/priority.py): metadata.priority
    # when a worker took up its first request (seconds; None: still queued): rates are measured
    # from here, so time spent waiting for a worker does not read as slowness
    work_started_at: float | None = None
    work_ended_at: float | None = None  # its last result so far (seconds; None: none yet)


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str  # "file-…"
    filename: str
    purpose: str  # "batch", "batch_output"
    bytes: int
    created_at: int
    path: str  # where the content lives under $BATCHMLX_HOME/files
    expires_at: int | None = None  # the worker deletes the file (record and bytes) after this


@dataclass(frozen=True, slots=True)
class ClaimedRequest:
    """A queued request a worker now holds under a lease."""

    id: int  # row id
    batch_id: str
    custom_id: str
    line: int
    endpoint: str
    model: str | None
    body: dict[str, Any]
    attempts: int  # including this claim
    priority: int = BATCH_PRIORITY  # the engine's (core/priority.py): its batch's, aged


@dataclass(frozen=True, slots=True)
class RequestResult:
    """What a worker records for one request: exactly one of these per request."""

    status: RequestStatus  # SUCCEEDED or FAILED
    status_code: int  # 200, or the HTTP status of the error body
    body: dict[str, Any] | None  # the response body (a completion, or {"error": {...}})
    error: dict[str, Any] | None = None  # OpenAI's line-level `error` (batch_expired, …)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cache_outcome: str | None = None  # "MISS", "HIT", "PREFIX_HIT"
