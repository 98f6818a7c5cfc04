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
from batchmlx.core.lifecycle import BatchStatus, RequestStatus
from batchmlx.core.records import BatchRecord, FileRecord, RequestResult
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.openai import (
    BATCH_CANCELLED_MESSAGE,
    IdPrefix,
    dumps_line,
    error_line,
    new_id,
    output_line,
)
from batchmlx.formats.validate import validate_batch_file
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
    store: Store, settings: Settings, data: bytes, *, filename: str, purpose: str, now: float
) -> FileRecord:
    file_id = new_id(IdPrefix.FILE)
    path = settings.files_dir / file_id
    write_atomic(path, data)
    rec = FileRecord(file_id, filename, purpose, len(data), int(now), str(path))
    await store.add_file(rec)
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
) -> BatchRecord:
    """Validate a batch input file and enqueue it; a file that fails gives a `failed` batch."""
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

    in_progress → finalizing → completed; cancelling → cancelled (files written the same way).
    Files are written atomically; redoing a finalize after a crash writes the same bytes.
    """
    rec = await get_batch(store, batch_id)
    if rec.status is BatchStatus.IN_PROGRESS:
        rec = await store.set_batch_status(batch_id, BatchStatus.FINALIZING, now)
    end = BatchStatus.CANCELLED if rec.status is BatchStatus.CANCELLING else BatchStatus.COMPLETED
    out, err = bytearray(), bytearray()
    outcomes = {"hits": 0, "prefix_hits": 0, "misses": 0}
    for row in await store.iter_results(batch_id):
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
                purpose="batch_output", now=now,
            )  # fmt: skip
            fields[key] = f.id
    return await store.set_batch_status(batch_id, end, now, **fields)


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


async def file_content(store: Store, file_id: str | None) -> bytes:
    if file_id is None:
        return b""
    f = await store.get_file(file_id)
    if f is None:
        raise ServiceError(f"no file with id {file_id!r}")
    return Path(f.path).read_bytes()
