"""What the CLI (and later the HTTP API) asks for: submit, finalize, cancel, results.

Each function takes an open Store and Settings, and `now` where time matters, so tests drive
them without clocks or processes. No MLX here.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus, RequestStatus, is_expired
from batchmlx.core.records import BatchRecord, FileRecord, RequestResult
from batchmlx.faults import crash_point
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.openai import (
    BATCH_CANCELLED_MESSAGE,
    BATCH_EXPIRED_MESSAGE,
    IdPrefix,
    dumps_line,
    error_line,
    new_id,
    output_line,
)
from batchmlx.formats.validate import validate_batch_file
from batchmlx.ingest.layout import result_paths
from batchmlx.store import NewRequest, Store

WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class ServiceError(Exception):
    """A request the user made that cannot be done (unknown id, finished batch, …)."""


def parse_window(window: str) -> int:
    """'24h' → 86400. OpenAI accepts only 24h; locally any positive s/m/h/d window works."""
    try:
        value, unit = int(window[:-1]), window[-1]
        seconds = value * WINDOW_UNITS[unit]
    except (ValueError, KeyError, IndexError):
        raise ServiceError(f"invalid completion window {window!r}; use e.g. 24h, 90m, 2d") from None
    if seconds <= 0:
        raise ServiceError(f"invalid completion window {window!r}: must be positive")
    return seconds


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file, flush it to disk, then rename: readers see all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


async def store_file(
    store: Store,
    settings: Settings,
    data: bytes,
    *,
    filename: str,
    purpose: str,
    now: float,
    file_id: str | None = None,
    expires_after: int | None = None,
) -> FileRecord:
    """Write `data` under files/ and record it; a given `file_id` replaces that file. With
    `expires_after` (seconds) the worker deletes it that long after `now`."""
    replace = file_id is not None
    file_id = file_id or new_id(IdPrefix.FILE)
    path = settings.files_dir / file_id
    write_atomic(path, data)
    expires_at = None if expires_after is None else int(now) + expires_after
    rec = FileRecord(file_id, filename, purpose, len(data), int(now), str(path), expires_at)
    await store.add_file(rec, replace=replace)
    return rec


def _model_resolves(settings: Settings):
    from batchmlx.models import resolve_model  # no MLX import

    return lambda name: resolve_model(name, cache_dir=settings.cache_dir) is not None


async def submit(
    store: Store,
    settings: Settings,
    data: bytes,
    *,
    filename: str,
    now: float,
    model: str | None = None,
    completion_window: str = "24h",
    metadata: dict[str, str] | None = None,
    source: str | None = "cli",
    output_expires_after: int | None = None,
) -> BatchRecord:
    """Validate a batch input file and enqueue it; a file that fails gives a `failed` batch.
    `output_expires_after` (seconds) makes its output and error files expire."""
    window_s = parse_window(completion_window)
    if model is not None and not _model_resolves(settings)(model):
        raise ServiceError(
            f"model {model!r} cannot be resolved: use 'default', a local MLX folder, "
            "a .gguf file or a hub id (org/name)"
        )
    file = await store_file(
        store, settings, data, filename=filename, purpose="batch", now=now
    )
    result = validate_batch_file(
        data, model_resolves=_model_resolves(settings), model_override=model
    )
    created = int(now)
    common = dict(
        id=new_id(IdPrefix.BATCH),
        endpoint=result.endpoint or (result.lines[0].url if result.lines else ""),
        model=model or result.model,
        input_file_id=file.id,
        completion_window=completion_window,
        created_at=created,
        expires_at=created + window_s,
        metadata=metadata,
        output_expires_after=output_expires_after,
    )
    if result.ok:
        rec = BatchRecord(status=BatchStatus.IN_PROGRESS, in_progress_at=created, **common)
        reqs = [NewRequest(line.line, line.custom_id, line.body) for line in result.lines]
    else:
        rec = BatchRecord(
            status=BatchStatus.FAILED, failed_at=created, errors=tuple(result.errors), **common
        )
        reqs = []
    content_hash = hashlib.sha256(data).hexdigest()
    await store.create_batch(rec, reqs, content_hash=content_hash, source=source)
    return await store.get_batch(rec.id)


async def get_batch(store: Store, batch_id: str) -> BatchRecord:
    rec = await store.get_batch(batch_id)
    if rec is None:
        raise ServiceError(f"no batch with id {batch_id!r}")
    return rec


_OUTCOME_KEYS = {"HIT": "hits", "PREFIX_HIT": "prefix_hits", "MISS": "misses"}


def _line_id(batch_id: str, custom_id: str, prefix: str) -> str:
    # derived, not random: finalizing twice (after a crash) writes the same bytes
    digest = hashlib.sha256(f"{batch_id}\0{custom_id}".encode()).hexdigest()[:24]
    return f"{prefix}{digest}"


async def finalize(
    store: Store, settings: Settings, batch_id: str, *, now: float
) -> BatchRecord:
    """Write the output and error files of a batch whose every request has a result.

    in_progress → finalizing → completed; cancelling → cancelled; in_progress → expired when
    requests carry `batch_expired` (see `expire`). Idempotent and resumable: file ids and line
    ids are derived from the batch, files are written atomically, and the status moves last, so
    redoing a finalize a crash interrupted writes the same bytes; a finished batch is returned.
    """
    rec = await get_batch(store, batch_id)
    if rec.status.terminal:
        return rec
    rows = await store.iter_results(batch_id)
    if rec.status is BatchStatus.CANCELLING:
        end = BatchStatus.CANCELLED
    elif rec.status is BatchStatus.IN_PROGRESS and any(
        (r.error or {}).get("code") == ErrorCode.BATCH_EXPIRED.value for r in rows
    ):
        end = BatchStatus.EXPIRED
    else:
        end = BatchStatus.COMPLETED
        if rec.status is BatchStatus.IN_PROGRESS:
            rec = await _move(store, batch_id, BatchStatus.FINALIZING, now)
            if rec.status.terminal:
                return rec
    crash_point("before_finalize")
    out, err = bytearray(), bytearray()
    outcomes = {"hits": 0, "prefix_hits": 0, "misses": 0}
    for row in rows:
        if row.cache_outcome in _OUTCOME_KEYS:
            outcomes[_OUTCOME_KEYS[row.cache_outcome]] += 1
        line_id = _line_id(batch_id, row.custom_id, IdPrefix.BATCH_REQUEST)
        if row.response_body is None:
            e = row.error or {"code": "server_error", "message": "no result"}
            err += dumps_line(
                error_line(id=line_id, custom_id=row.custom_id, code=e["code"],
                           message=e["message"])
            )  # fmt: skip
            continue
        line = output_line(
            id=line_id,
            custom_id=row.custom_id,
            status_code=row.status_code or 200,
            request_id=_line_id(batch_id, row.custom_id, "req_"),
            body=row.response_body,
        )
        (out if row.status is RequestStatus.SUCCEEDED else err).extend(dumps_line(line))
    await store.update_batch_stats(batch_id, outcomes)
    fields: dict[str, Any] = {}
    for data, key, suffix in ((out, "output_file_id", "output"), (err, "error_file_id", "errors")):
        if data:
            f = await store_file(
                store, settings, bytes(data), filename=f"{batch_id}_{suffix}.jsonl",
                purpose="batch_output", now=now, file_id=_line_id(batch_id, suffix, "file-"),
                expires_after=rec.output_expires_after,
            )  # fmt: skip
            fields[key] = f.id
        if suffix == "output":
            crash_point("mid_finalize")
    served = _served_model(rows)
    if served is not None:
        fields["model"] = served  # the model actually used, as its response bodies name it
    await _write_inbox_results(store, batch_id, bytes(out), bytes(err))
    crash_point("after_finalize_files")
    return await _move(store, batch_id, end, now, **fields)


def _served_model(rows) -> str | None:
    for row in rows:
        body = row.response_body
        if row.status is RequestStatus.SUCCEEDED and isinstance(body, dict):
            if isinstance(body.get("model"), str):
                return body["model"]
    return None


async def _move(store: Store, batch_id: str, status: BatchStatus, now: float, **fields: Any):
    """Move a batch on; when another worker finalizing the same batch got there first (its
    files are the same bytes: ids are derived), take the batch as that worker left it."""
    from batchmlx.core.lifecycle import TransitionError

    try:
        return await store.set_batch_status(batch_id, status, now, **fields)
    except TransitionError:
        current = await get_batch(store, batch_id)
        if current.status is status or current.status.terminal:
            return current
        raise


async def _write_inbox_results(store: Store, batch_id: str, out: bytes, err: bytes) -> None:
    """A batch from an inbox also gets DIR/results/NAME.output.jsonl (and .errors.jsonl)."""
    paths = result_paths(await store.batch_source(batch_id))
    if paths is None:
        return
    write_atomic(paths[0], out)
    if err:
        write_atomic(paths[1], err)
    else:
        paths[1].unlink(missing_ok=True)


async def cancel(store: Store, batch_id: str, *, now: float) -> BatchRecord:
    rec = await get_batch(store, batch_id)
    if rec.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        return rec
    if rec.status is not BatchStatus.IN_PROGRESS:
        raise ServiceError(f"batch {batch_id} is {rec.status.value}; it cannot be cancelled")
    return await store.set_batch_status(batch_id, BatchStatus.CANCELLING, now)


CANCELLED_RESULT = RequestResult(
    status=RequestStatus.FAILED,
    status_code=0,
    body=None,
    error={"code": ErrorCode.BATCH_CANCELLED.value, "message": BATCH_CANCELLED_MESSAGE},
)


async def settle_cancelling(store: Store, settings: Settings, batch_id: str, *, now: float):
    """Give every unfinished request of a cancelling batch its `batch_cancelled` line and
    finalize it as cancelled. Done by the worker (after aborting its running requests) or by
    `cancel` itself when no worker runs."""
    await store.finish_unfinished(batch_id, CANCELLED_RESULT, now)
    return await finalize(store, settings, batch_id, now=now)


EXPIRED_RESULT = RequestResult(
    status=RequestStatus.FAILED,
    status_code=0,
    body=None,
    error={"code": ErrorCode.BATCH_EXPIRED.value, "message": BATCH_EXPIRED_MESSAGE},
)


async def expire(store: Store, settings: Settings, batch_id: str, *, now: float) -> BatchRecord:
    """End a batch whose completion window has passed: finished results are kept, every
    unfinished request gets a `batch_expired` line, and the batch ends `expired` (or
    `completed`, if everything had finished in time). The worker aborts the batch's running
    requests first; with no worker, `status` calls this itself. Safe to redo after a crash."""
    rec = await get_batch(store, batch_id)
    if rec.status is not BatchStatus.IN_PROGRESS or not is_expired(
        rec.status, rec.expires_at, now
    ):
        return rec
    await store.finish_unfinished(batch_id, EXPIRED_RESULT, now)
    return await finalize(store, settings, batch_id, now=now)


async def file_content(store: Store, file_id: str | None) -> bytes:
    if file_id is None:
        return b""
    f = await store.get_file(file_id)
    if f is None:
        raise ServiceError(f"no file with id {file_id!r}")
    return Path(f.path).read_bytes()


# -- the HTTP API: batches from uploaded files, validated after create (as OpenAI does) --------


async def create_batch(
    store: Store,
    settings: Settings,
    *,
    input_file_id: str,
    endpoint: str,
    now: float,
    completion_window: str = "24h",
    metadata: dict[str, str] | None = None,
    source: str | None = "api",
    output_expires_after: int | None = None,
) -> BatchRecord:
    """Create a `validating` batch from an uploaded file; `validate_batch` runs it or fails it."""
    from batchmlx.formats.validate import SUPPORTED_URLS

    if endpoint not in SUPPORTED_URLS:
        raise ServiceError(
            f"unsupported endpoint {endpoint!r}; supported: {', '.join(SUPPORTED_URLS)}"
        )
    window_s = parse_window(completion_window)
    f = await store.get_file(input_file_id)
    if f is None:
        raise ServiceError(f"no file with id {input_file_id!r}")
    if f.purpose != "batch":
        raise ServiceError(f"file {input_file_id} has purpose {f.purpose!r}, not 'batch'")
    created = int(now)
    rec = BatchRecord(
        id=new_id(IdPrefix.BATCH), endpoint=endpoint, model=None, input_file_id=input_file_id,
        completion_window=completion_window, status=BatchStatus.VALIDATING, created_at=created,
        expires_at=created + window_s, metadata=metadata,
        output_expires_after=output_expires_after,
    )  # fmt: skip
    await store.create_batch(rec, [], source=source)
    return await store.get_batch(rec.id)


async def validate_batch(
    store: Store, settings: Settings, batch_id: str, *, now: float, model: str | None = None
) -> BatchRecord:
    """validating → in_progress (requests enqueued) or failed (with its errors). `model` serves
    the whole file whatever its bodies name, like `submit --model`. Safe to race: one wins."""
    import asyncio

    from batchmlx.core.lifecycle import TransitionError
    from batchmlx.core.records import BatchErrorRecord

    rec = await get_batch(store, batch_id)
    if rec.status is not BatchStatus.VALIDATING:
        return rec
    f = await store.get_file(rec.input_file_id)
    data = Path(f.path).read_bytes() if f is not None and Path(f.path).is_file() else None
    if data is None:
        missing = f"The input file {rec.input_file_id} no longer exists."
        errors = (BatchErrorRecord(ErrorCode.INVALID_REQUEST.value, missing),)
        result = None
    else:
        result = await asyncio.to_thread(
            validate_batch_file, data, model_resolves=_model_resolves(settings),
            model_override=model,
        )  # fmt: skip
        errors = tuple(result.errors)
        if result.ok and result.endpoint != rec.endpoint:
            errors = (
                BatchErrorRecord(
                    ErrorCode.URL_MISMATCH.value,
                    f"The input file's requests use {result.endpoint!r}, but the batch was "
                    f"created for {rec.endpoint!r}.",
                    param="endpoint",
                ),
            )
    if not errors and result is not None:
        reqs = [NewRequest(line.line, line.custom_id, line.body) for line in result.lines]
        await store.start_validated_batch(
            batch_id, reqs, now, model=result.model, content_hash=hashlib.sha256(data).hexdigest()
        )
    else:
        try:
            await store.set_batch_status(batch_id, BatchStatus.FAILED, now, errors=errors)
        except TransitionError:
            pass  # another process validated it meanwhile
    return await get_batch(store, batch_id)


async def delete_expired_files(store: Store, *, now: float) -> list[str]:
    """Delete every file past its `expires_at`, record and bytes (the worker's housekeeping);
    returns their ids."""
    gone = []
    for f in await store.expired_files(now):
        if await delete_file(store, f.id):
            gone.append(f.id)
    return gone


async def delete_file(store: Store, file_id: str) -> bool:
    """Forget a file and remove its bytes; False when there is no such file."""
    rec = await store.delete_file(file_id)
    if rec is None:
        return False
    Path(rec.path).unlink(missing_ok=True)
    return True
