"""One intake path for every caller: create the batch `validating`, then validate it.

The HTTP API answers between the two (OpenAI validates after create); the CLI's `submit` and
the inbox call both at once through `submit`. Only `validate_batch` enqueues requests.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable

from batchmlx.batches.errors import BatchError
from batchmlx.batches.files import delete_file, store_file
from batchmlx.batches.finalize import get_batch
from batchmlx.batches.windows import parse_window
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus, TransitionError
from batchmlx.core.records import BatchErrorRecord, BatchRecord, FileRecord
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.openai import IdPrefix, new_id
from batchmlx.formats.validate import SUPPORTED_URLS, validate_batch_file
from batchmlx.store import NewRequest, Store


def _model_resolves(settings: Settings) -> Callable[[str], bool]:
    from batchmlx.core.models import resolve_model

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
    """Store a batch input file, create its batch and validate it at once (the CLI, the
    inbox); a file that fails validation gives a `failed` batch. `output_expires_after`
    (seconds) makes its output and error files expire."""
    parse_window(completion_window)
    if model is not None and not _model_resolves(settings)(model):
        raise BatchError(
            f"model {model!r} cannot be resolved: use 'default', a local MLX folder, "
            "a .gguf file or a hub id (org/name)"
        )
    file = await store_file(store, settings, data, filename=filename, purpose="batch", now=now)
    try:  # no input file without its batch: what fails here leaves nothing behind
        rec = await create_batch(
            store, settings, input_file_id=file.id, endpoint=None, now=now,
            completion_window=completion_window, metadata=metadata, source=source,
            content_hash=hashlib.sha256(data).hexdigest(),
            output_expires_after=output_expires_after,
        )  # fmt: skip
    except Exception:
        await delete_file(store, file.id)
        raise
    return await validate_batch(store, settings, rec.id, now=now, model=model, data=data)


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
    """Create a `validating` batch from a stored file; `validate_batch` runs it or fails it.
    `endpoint` None: the file's own (the CLI and the inbox name none)."""
    if endpoint is not None and endpoint not in SUPPORTED_URLS:
        raise BatchError(
            f"unsupported endpoint {endpoint!r}; supported: {', '.join(SUPPORTED_URLS)}"
        )
    window_s = parse_window(completion_window)
    f = await store.get_file(input_file_id)
    if f is None:
        raise BatchError(f"no file with id {input_file_id!r}")
    if f.purpose != "batch":
        raise BatchError(f"file {input_file_id} has purpose {f.purpose!r}, not 'batch'")
    created = int(now)
    rec = BatchRecord(
        id=new_id(IdPrefix.BATCH), endpoint=endpoint or "", model=None,
        input_file_id=input_file_id, completion_window=completion_window,
        status=BatchStatus.VALIDATING, created_at=created, expires_at=created + window_s,
        metadata=metadata, output_expires_after=output_expires_after,
    )  # fmt: skip
    await store.create_batch(rec, content_hash=content_hash, source=source)
    return await get_batch(store, rec.id)


async def _read_input(store: Store, f: FileRecord | None, file_id: str) -> tuple[bytes | None, str]:
    """The input file's bytes, wherever they are stored, or None and why not."""
    if f is None:
        return None, f"The input file {file_id} no longer exists."
    try:
        return await store.read_file_bytes(f), ""
    except FileNotFoundError:
        return None, f"The input file {file_id} no longer exists."
    except OSError as exc:  # the batch fails once, not validated again every poll
        return None, f"The input file {file_id} cannot be read: {exc.strerror}."


async def validate_batch(
    store: Store,
    settings: Settings,
    batch_id: str,
    *,
    now: float,
    model: str | None = None,
    data: bytes | None = None,
) -> BatchRecord:
    """validating → in_progress (requests enqueued) or failed (with its errors). `model` serves
    the whole file whatever its bodies name, like `submit --model`; `data`: the input file's
    bytes when the caller has them. Safe to race: one wins."""
    rec = await get_batch(store, batch_id)
    if rec.status is not BatchStatus.VALIDATING:
        return rec
    if data is None:
        f = await store.get_file(rec.input_file_id)
        data, unreadable = await _read_input(store, f, rec.input_file_id)
    if data is None:
        await _fail(store, batch_id, now, (BatchErrorRecord(ErrorCode.INVALID_REQUEST.value,
                                                            unreadable),))  # fmt: skip
        return await get_batch(store, batch_id)
    result = await asyncio.to_thread(
        validate_batch_file, data, model_resolves=_model_resolves(settings), model_override=model
    )
    errors = tuple(result.errors)
    # a batch created without an endpoint (CLI, inbox) takes its file's
    endpoint = rec.endpoint or result.endpoint or (result.lines[0].url if result.lines else "")
    if result.ok and result.endpoint != endpoint:
        errors = (
            BatchErrorRecord(
                ErrorCode.URL_MISMATCH.value,
                f"The input file's requests use {result.endpoint!r}, but the batch was "
                f"created for {rec.endpoint!r}.",
                param="endpoint",
            ),
        )
    fields = {} if rec.endpoint else {"endpoint": endpoint, "model": model or result.model}
    if errors:
        await _fail(store, batch_id, now, errors, **fields)
    else:
        reqs = [NewRequest(line.line, line.custom_id, line.body_json) for line in result.lines]
        await store.start_validated_batch(
            batch_id, reqs, now, model=result.model, endpoint=endpoint,
            content_hash=hashlib.sha256(data).hexdigest(),
        )  # fmt: skip
    return await get_batch(store, batch_id)


async def _fail(
    store: Store, batch_id: str, now: float, errors: tuple[BatchErrorRecord, ...], **fields: object
) -> None:
    try:
        await store.set_batch_status(batch_id, BatchStatus.FAILED, now, errors=errors, **fields)
    except TransitionError:
        pass  # another process validated it meanwhile
