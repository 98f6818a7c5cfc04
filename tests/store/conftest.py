"""Helpers for store tests: real databases, driven by asyncio.run.

Every test that takes `with_store` (or `store_target`) runs twice: on a SQLite file under
tmp_path and on a fresh database of the suite's PostgreSQL server. `@pytest.mark.dialects("sqlite")`
keeps a test to the dialects it names.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from batchmlx.core.lifecycle import BatchStatus, RequestStatus
from batchmlx.core.records import BatchRecord, RequestResult
from batchmlx.store import NewRequest, Store

StoreFn = Callable[[Store], Awaitable[Any]]


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "batchmlx.db"


@pytest.fixture
def with_store(store_target: str | Path) -> Callable[[StoreFn], Any]:
    """Run `fn(store)` in a fresh event loop against the test's database."""

    def run(fn: StoreFn) -> Any:
        async def main() -> Any:
            store = await Store.open(store_target)
            try:
                return await fn(store)
            finally:
                await store.close()

        return asyncio.run(main())

    return run


def batch(
    batch_id: str,
    created_at: int = 1000,
    status: BatchStatus = BatchStatus.IN_PROGRESS,
    **fields: Any,
) -> BatchRecord:
    return BatchRecord(
        id=batch_id,
        endpoint="/v1/chat/completions",
        model="tiny",
        input_file_id=f"file-{batch_id}",
        completion_window="24h",
        status=status,
        created_at=created_at,
        **fields,
    )


async def add_batch(
    store: Store,
    rec: BatchRecord,
    requests: Sequence[NewRequest] = (),
    *,
    content_hash: str | None = None,
    source: str | None = None,
) -> None:
    """Store `rec`; with requests, the way intake does it: created `validating`, then started
    (in_progress_at: the record's, else its created_at)."""
    if not requests:
        await store.create_batch(rec, content_hash=content_hash, source=source)
        return
    assert rec.status is BatchStatus.IN_PROGRESS, "only an in_progress batch has requests"
    validating = replace(rec, status=BatchStatus.VALIDATING, in_progress_at=None)
    await store.create_batch(validating, content_hash=content_hash, source=source)
    started = await store.start_validated_batch(
        rec.id, requests, rec.in_progress_at or rec.created_at, model=rec.model
    )
    assert started


def new_requests(n: int, prefix: str = "req") -> list[NewRequest]:
    return [
        NewRequest(
            line=i + 1,
            custom_id=f"{prefix}-{i + 1}",
            body={"model": "tiny", "messages": [{"role": "user", "content": f"q{i + 1}"}]},
        )
        for i in range(n)
    ]


def ok(prompt: int = 10, cached: int = 0, completion: int = 5) -> RequestResult:
    return RequestResult(
        status=RequestStatus.SUCCEEDED,
        status_code=200,
        body={"object": "chat.completion", "choices": []},
        prompt_tokens=prompt,
        cached_tokens=cached,
        completion_tokens=completion,
        cache_outcome="MISS",
    )


def failed(code: int = 400) -> RequestResult:
    return RequestResult(
        status=RequestStatus.FAILED,
        status_code=code,
        body={"error": {"message": "bad", "type": "invalid_request_error"}},
    )


def fetch_rows(store_target: str | Path, sql: str) -> list[tuple[Any, ...]]:
    """Rows of a raw SQL query, read outside the store (either dialect)."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    from batchmlx.database_url import parse_target

    async def main() -> list[tuple[Any, ...]]:
        engine = create_async_engine(parse_target(store_target).url)
        try:
            async with engine.connect() as conn:
                return [tuple(r) for r in await conn.execute(text(sql))]
        finally:
            await engine.dispose()

    return asyncio.run(main())


def execute_sql(store_target: str | Path, sql: str) -> None:
    """Run a raw SQL statement outside the store and commit it (either dialect)."""
    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    from batchmlx.database_url import parse_target

    async def main() -> None:
        engine = create_async_engine(parse_target(store_target).url)
        try:
            async with engine.begin() as conn:
                await conn.execute(text(sql))
        finally:
            await engine.dispose()

    asyncio.run(main())
