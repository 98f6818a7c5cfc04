"""Finalize a batch whose every request has a result: render (formats/output), write, move.

The files are streamed: rows come from the store in line order a few hundred at a time and
their lines go out in 1 MiB chunks, so a batch with 200 MB of results is never whole in memory.
Hooks the caller passes (`hooks`) see the written files before the status moves: the inbox
copies them to its results/ folder that way, so this package knows nothing of the inbox. The
composition roots (the CLI's commands, the server's startup) decide which hooks a process runs."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batchmlx.batches.errors import BatchError
from batchmlx.batches.files import store_file
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus, TransitionError
from batchmlx.core.records import BatchRecord, FileRecord
from batchmlx.faults import crash_point
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.output import ResultRenderer, derived_id
from batchmlx.store import Store
from batchmlx.store.blobs import rechunk

log = logging.getLogger("batchmlx.batches")


@dataclass(frozen=True, slots=True)
class Finalized:
    """What a finalize hook is told: the batch and the ids of its two files (None: no lines;
    read them streamed, `batches.files.copy_file`)."""

    batch_id: str
    output_file_id: str | None
    error_file_id: str | None


# run after a batch's files are written and before it moves on (so a crash redoes it): a hook
# must be idempotent
FinalizeHook = Callable[[Store, Finalized], Awaitable[None]]
FinalizeHooks = Sequence[FinalizeHook]  # what callers pass down to finalize, in order


async def get_batch(store: Store, batch_id: str) -> BatchRecord:
    rec = await store.get_batch(batch_id)
    if rec is None:
        raise BatchError(f"no batch with id {batch_id!r}")
    return rec


async def finalize(
    store: Store, settings: Settings, batch_id: str, *, now: float, hooks: FinalizeHooks = ()
) -> BatchRecord:
    """Write the output and error files of a batch whose every request has a result.

    in_progress → finalizing → completed; cancelling → cancelled; in_progress → expired when
    requests carry `batch_expired` (see `expire`). Idempotent and resumable: file ids and line
    ids are derived from the batch, files are written atomically, and the status moves last, so
    redoing a finalize a crash interrupted writes the same bytes; a finished batch is returned.
    Runs once per batch whichever host gets there: the others find the batch locked (and
    return it as it is) or finished. `hooks` run once the files are written.
    """
    async with store.batch_lock(batch_id) as mine:
        if not mine:
            return await get_batch(store, batch_id)  # another process is finalizing it
        return await _finalize(store, settings, batch_id, now=now, hooks=hooks)


async def _finalize(
    store: Store, settings: Settings, batch_id: str, *, now: float, hooks: FinalizeHooks
) -> BatchRecord:
    rec = await get_batch(store, batch_id)
    if rec.status.terminal:
        return rec
    crash_point("finalize_start")
    if rec.status is BatchStatus.CANCELLING:
        end = BatchStatus.CANCELLED
    elif rec.status is BatchStatus.IN_PROGRESS and await store.has_error_code(
        batch_id, ErrorCode.BATCH_EXPIRED.value
    ):
        end = BatchStatus.EXPIRED
    else:
        end = BatchStatus.COMPLETED
        if rec.status is BatchStatus.IN_PROGRESS:
            rec = await _move(store, batch_id, BatchStatus.FINALIZING, now)
            if rec.status is not BatchStatus.FINALIZING:
                return rec  # cancelled meanwhile (settled next) or finished by another worker
    crash_point("before_finalize")
    # each file streamed from the rows (line order) into its store, never whole in memory
    renderer = ResultRenderer(batch_id)
    fields: dict[str, Any] = {}
    for output, key, suffix in ((True, "output_file_id", "output"),
                                (False, "error_file_id", "errors")):  # fmt: skip
        f = await _write_file(store, settings, rec, renderer, output, suffix, now)
        if f is not None:
            fields[key] = f.id
        if output:
            crash_point("mid_finalize")
    await store.update_batch_stats(batch_id, renderer.outcomes)
    if renderer.served_model is not None:
        fields["model"] = renderer.served_model  # the model actually used, as its bodies name it
    for hook in hooks:
        await hook(store, Finalized(batch_id, fields.get("output_file_id"),
                                    fields.get("error_file_id")))  # fmt: skip
    crash_point("after_finalize_files")
    return await _move(store, batch_id, end, now, **fields)


async def _write_file(
    store: Store,
    settings: Settings,
    rec: BatchRecord,
    renderer: ResultRenderer,
    output: bool,
    suffix: str,
    now: float,
) -> FileRecord | None:
    """Render the rows of the output (or error) file into it; None (no file) when it has none."""

    async def lines() -> AsyncIterator[bytes]:
        async for row in store.stream_results(rec.id, output=output):
            if renderer.to_output(row) is not output:  # the store and formats must agree
                raise RuntimeError(f"batch {rec.id}: line {row.line} selected for the wrong file")
            yield renderer.render(row)

    chunks = rechunk(lines())
    first = await anext(chunks, None)
    if first is None:
        return None

    async def all_chunks() -> AsyncIterator[bytes]:
        yield first
        async for chunk in chunks:
            yield chunk

    return await store_file(
        store, settings, all_chunks(), filename=f"{rec.id}_{suffix}.jsonl",
        purpose="batch_output", now=now, file_id=derived_id(rec.id, suffix, "file-"),
        expires_after=rec.output_expires_after,
    )  # fmt: skip


async def _move(
    store: Store, batch_id: str, status: BatchStatus, now: float, **fields: Any
) -> BatchRecord:
    """Move a batch on; when someone else moved it first (another worker finalizing the same
    batch, whose files are the same bytes since ids are derived; a cancel that arrived while
    this one finalized), take the batch as they left it: whoever acts next settles it."""
    try:
        return await store.set_batch_status(batch_id, status, now, **fields)
    except TransitionError:
        current = await get_batch(store, batch_id)
        if current.status is not status:
            log.info("batch %s: moved to %s meanwhile, not %s", batch_id,
                     current.status.value, status.value)  # fmt: skip
        return current
