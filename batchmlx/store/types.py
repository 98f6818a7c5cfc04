"""Plain records the store takes and gives that are not shared with other layers."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from batchmlx.core.lifecycle import BatchStatus, RequestStatus


@dataclass(frozen=True, slots=True)
class NewRequest:
    """One valid input line to enqueue."""

    line: int  # 1-based line of the input file
    custom_id: str
    # the request body (`body` of the input line); a str is that body already as JSON
    body: dict[str, Any] | str


@dataclass(frozen=True, slots=True)
class ResultRow:
    """A done request, as finalisation reads it to write the output and error files."""

    id: int  # row id
    custom_id: str
    line: int
    status: RequestStatus  # SUCCEEDED or FAILED
    status_code: int | None
    response_body: dict[str, Any] | None
    error: dict[str, Any] | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cache_outcome: str | None
    attempts: int
    finished_at: float | None


@dataclass(frozen=True, slots=True)
class BatchRef:
    """A batch's identity without its request counts: cheap enough for the worker's hot loop."""

    id: str
    status: BatchStatus
    endpoint: str
    model: str | None
    created_at: int
    expires_at: int | None = None  # end of the completion window (unix seconds)
    priority: int = 0  # lower is claimed first (core/priority.py)


class FileStorage(enum.Enum):
    """Where file bytes live (see blobs.py)."""

    LOCAL = "local"  # $BATCHMLX_HOME/files on this host: SQLite's default
    DATABASE = "database"  # chunks in the database: PostgreSQL's default, hosts share no disk


class StoreUnavailable(RuntimeError):
    """The database cannot be reached or opened (the message says which and why)."""
