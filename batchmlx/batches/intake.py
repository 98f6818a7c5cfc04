"""One intake path for every caller: create the batch `validating`, then validate it.

The HTTP API answers between the two (OpenAI validates after create); the CLI's `submit` and
the inbox call both at once through `submit`. Only `validate_batch` enqueues requests. Files
stream through both: in as chunks, validated and enqueued a chunk at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from functools import partial

from batchmlx.batches.errors import BatchError
from batchmlx.batches.files import Hashed, delete_file, store_file
from batchmlx.batches.finalize import get_batch
from batchmlx.batches.models import choose, chosen_override, dedup_key, rule_of
from batchmlx.batches.windows import parse_window
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus, TransitionError
from batchmlx.core.model_rule import ModelRule
from batchmlx.core.records import BatchErrorRecord, BatchRecord, FileRecord
from batchmlx.formats.batch_request import batch_priority, endpoint_problem, metadata_problem
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.openai import IdPrefix, new_id
from batchmlx.formats.request import Endpoint
from batchmlx.formats.validate import (
    FileValidator,
    LineSplitter,
    ValidationResult,
    too_large,
)
from batchmlx.store import NewRequest, Store
from batchmlx.store.blobs import Chunks
from batchmlx.store.store import Enqueue


async def submit(
    store: Store,
    settings: Settings,
    data: bytes | Chunks,
    *,
    filename: str,
    now: float,
    model: str | None = None,
    endpoint: str | None = None,
    completion_window: str = "24h",
    metadata: dict[str, str] | None = None,
    source: str | None = "cli",
    output_expires_after: int | None = None,
) -> BatchRecord:
    """Store a batch input file (bytes, or chunks streamed in), create its batch and validate
    it at once (the CLI, the inbox); a file that fails validation gives a `failed` batch.
    `endpoint` None: the file's own. `output_expires_after` (seconds) makes its output and
    error files expire."""
    parse_window(completion_window)
    problem = metadata_problem(metadata)
    if problem is not None:
        raise BatchError(problem.message)
    if model is not None:
        model = await asyncio.to_thread(chosen_override, model, rule_of(settings))
    hashed = Hashed(data)
    file = await store_file(store, settings, hashed, filename=filename, purpose="batch", now=now)
    # no input file without its batch: what fails here leaves nothing behind; no content_hash
    # yet: the duplicate key holds the model, set once validation has chosen it
    try:
        rec = await create_batch(
            store, settings, input_file_id=file.id, endpoint=endpoint, now=now,
            completion_window=completion_window, metadata=metadata, source=source,
            output_expires_after=output_expires_after,
        )  # fmt: skip
    except Exception:
        await delete_file(store, file.id)
        raise
    return await validate_batch(store, settings, rec.id, now=now, model=model)


async def create_batch(
    store: Store,
    settings: Settings,
    *,
    input_file_id: str,
    endpoint: str | None,
    now: float,
    completion_window: str = "24h",
    metadata: dict[str, str] | None = None,
    source: str | None = "api",
    content_hash: str | None = None,
    output_expires_after: int | None = None,
) -> BatchRecord:
    """Create a `validating` batch from a file; `validate_batch` runs it or fails it (a file
    that does not exist fails it, as OpenAI does). `endpoint` None: the file's own (the CLI and
    the inbox name none)."""
    problem = None if endpoint is None else endpoint_problem(endpoint)
    if problem is not None:
        raise BatchError(problem.message)
    window_s = parse_window(completion_window)
    f = await store.get_file(input_file_id)
    if f is not None and f.purpose != "batch":
        raise BatchError(f"file {input_file_id} has purpose {f.purpose!r}, not 'batch'")
    created = int(now)
    rec = BatchRecord(
        id=new_id(IdPrefix.BATCH), endpoint=endpoint or "", model=None,
        input_file_id=input_file_id, completion_window=completion_window,
        status=BatchStatus.VALIDATING, created_at=created, expires_at=created + window_s,
        metadata=metadata, output_expires_after=output_expires_after,
        priority=batch_priority(metadata),
    )  # fmt: skip
    await store.create_batch(rec, content_hash=content_hash, source=source)
    return await get_batch(store, rec.id)


def _unreadable(file_id: str, exc: OSError | None = None) -> BatchErrorRecord:
    if exc is None or isinstance(exc, FileNotFoundError):
        # OpenAI's answer (its "or organization ... does not have access to it" has no
        # counterpart here), param included
        message = f"Cannot find file {file_id}."
    else:  # the batch fails once, not validated again every poll
        message = f"The input file {file_id} cannot be read: {exc.strerror}."
    return BatchErrorRecord(ErrorCode.INVALID_REQUEST.value, message, param="file_id")


async def validate_batch(
    store: Store,
    settings: Settings,
    batch_id: str,
    *,
    now: float,
    model: str | None = None,
    rule: ModelRule | None = None,
) -> BatchRecord:
    """validating → in_progress (requests enqueued) or failed (with its errors). `model` serves the
    whole file whatever its bodies name, like `submit --model`; otherwise `rule` (default: the
    settings') chooses the model for the bodies' name (docs/models.md). The stored file is read
    in chunks and validated a line at a time, good lines enqueued as they come in the one
    transaction that starts the batch (so a 200 MB file is never whole in memory, and a file
    that fails on its last line leaves nothing enqueued). Safe to race: one wins."""
    rec = await get_batch(store, batch_id)
    if rec.status is not BatchStatus.VALIDATING:
        return rec
    f = await store.get_file(rec.input_file_id)
    if f is None:
        await _fail(store, batch_id, now, (_unreadable(rec.input_file_id),))
        return await get_batch(store, batch_id)
    errors: tuple[BatchErrorRecord, ...] = ()
    fields: dict[str, object] = {}
    over = too_large(f.bytes)
    async with store.enqueue(batch_id) as q:
        if q is None:  # another process validated it meanwhile
            return await get_batch(store, batch_id)
        result: ValidationResult | None = over
        digest = ""
        if over is None:
            try:
                result, digest = await _check_and_enqueue(
                    store, f, q, model, rule or rule_of(settings), rec.endpoint or None
                )
            except _Unreadable as exc:
                result, errors = None, (_unreadable(rec.input_file_id, exc.cause),)
        if result is not None:
            errors = result.errors
            # a batch created without an endpoint (CLI, inbox) takes its file's; a file that
            # names none (empty, or no good url) the default one: a Batch's endpoint is never ""
            endpoint = rec.endpoint or result.endpoint or Endpoint.CHAT.value
            fields = {} if rec.endpoint else {"endpoint": endpoint, "model": model or result.model}
            if not errors:
                key = dedup_key(digest, result.model)
                await q.start(now, model=result.model, endpoint=endpoint, content_hash=key)
    if errors:  # nothing was enqueued: the block ended without starting the batch
        await _fail(store, batch_id, now, errors, **fields)
    return await get_batch(store, batch_id)


class _Unreadable(Exception):
    def __init__(self, cause: OSError) -> None:
        self.cause = cause


async def _read(store: Store, f: FileRecord) -> AsyncIterator[bytes]:
    """The file's chunks; a file gone or unreadable raises _Unreadable (not any OSError the
    enqueue may meet)."""
    chunks = store.read_file(f)
    while True:
        try:
            chunk = await anext(chunks)
        except StopAsyncIteration:
            return
        except OSError as exc:
            raise _Unreadable(exc) from exc
        yield chunk


async def _check_and_enqueue(
    store: Store,
    f: FileRecord,
    q: Enqueue,
    model: str | None,
    rule: ModelRule,
    endpoint: str | None,
) -> tuple[ValidationResult, str]:
    """Validate the stored file chunk by chunk (off the event loop), adding its good lines to
    `q` while it has no error; the result (without lines) and the file's SHA-256. A chunk's
    requests are written while the next chunk is validated (the database's work releases the
    GIL), one write at a time."""
    validator = FileValidator(endpoint=endpoint, model_override=model)
    splitter = LineSplitter()
    sha = hashlib.sha256()

    def check(lines: list[tuple[int, bytes]]) -> list[NewRequest]:
        return [NewRequest(g.line, g.custom_id, g.body_json) for g in validator.check_lines(lines)]

    writing: asyncio.Task[None] | None = None
    try:
        async for chunk in _read(store, f):
            sha.update(chunk)
            good = await asyncio.to_thread(check, splitter.feed(chunk))
            if writing is not None:
                await writing
            writing = asyncio.create_task(q.add(good))
        good = await asyncio.to_thread(check, splitter.end())
        if writing is not None:
            await writing
        await q.add(good)
    finally:
        if writing is not None and not writing.done():
            writing.cancel()
            with contextlib.suppress(BaseException):
                await writing
    result = await asyncio.to_thread(validator.finish, model_choice=partial(choose, rule=rule))
    return result, sha.hexdigest()


async def _fail(
    store: Store, batch_id: str, now: float, errors: tuple[BatchErrorRecord, ...], **fields: object
) -> None:
    try:
        await store.set_batch_status(batch_id, BatchStatus.FAILED, now, errors=errors, **fields)
    except TransitionError:
        pass  # another process validated it meanwhile
