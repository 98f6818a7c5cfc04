"""Cancel and expiry: the rules, and who settles a batch when no worker runs."""

from __future__ import annotations

from batchmlx.batches.errors import CannotCancel
from batchmlx.batches.finalize import FinalizeHooks, finalize, get_batch
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus, RequestStatus, TransitionError, is_expired
from batchmlx.core.records import BatchRecord, RequestResult
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.openai import BATCH_CANCELLED_MESSAGE, BATCH_EXPIRED_MESSAGE
from batchmlx.store import Store

CANCELLED_RESULT = RequestResult(
    status=RequestStatus.FAILED,
    status_code=0,
    body=None,
    error={"code": ErrorCode.BATCH_CANCELLED.value, "message": BATCH_CANCELLED_MESSAGE},
)
EXPIRED_RESULT = RequestResult(
    status=RequestStatus.FAILED,
    status_code=0,
    body=None,
    error={"code": ErrorCode.BATCH_EXPIRED.value, "message": BATCH_EXPIRED_MESSAGE},
)


async def cancel(store: Store, batch_id: str, *, now: float) -> BatchRecord:
    """in_progress → cancelling; a batch already cancelling or cancelled is returned as is."""
    rec = await get_batch(store, batch_id)
    if rec.status in (BatchStatus.CANCELLING, BatchStatus.CANCELLED):
        return rec
    if rec.status is not BatchStatus.IN_PROGRESS:
        raise CannotCancel(rec.status.value)
    try:
        return await store.set_batch_status(batch_id, BatchStatus.CANCELLING, now)
    except TransitionError:
        return await cancel(store, batch_id, now=now)  # it moved on meanwhile (finalizing)


async def cancel_unattended(
    store: Store,
    settings: Settings,
    batch_id: str,
    *,
    now: float,
    worker_alive: bool = False,
    hooks: FinalizeHooks = (),
) -> BatchRecord:
    """Cancel, and settle the cancel here when no worker runs to do it (the CLI's `cancel`,
    POST /v1/batches/{id}/cancel). `worker_alive`: the caller knows its own worker runs."""
    rec = await cancel(store, batch_id, now=now)
    if rec.status is not BatchStatus.CANCELLING or worker_alive:
        return rec
    if await store.live_workers(now, settings.lease_s):
        return rec  # that worker aborts the batch's running requests, then settles it
    return await settle_cancelling(store, settings, batch_id, now=now, hooks=hooks)


async def settle_cancelling(
    store: Store, settings: Settings, batch_id: str, *, now: float, hooks: FinalizeHooks = ()
) -> BatchRecord:
    """Give every unfinished request of a cancelling batch its `batch_cancelled` line and
    finalize it as cancelled. Done by the worker (after aborting its running requests) or by
    `cancel_unattended` when no worker runs."""
    await store.finish_unfinished(batch_id, CANCELLED_RESULT, now)
    return await finalize(store, settings, batch_id, now=now, hooks=hooks)


async def expire(
    store: Store, settings: Settings, batch_id: str, *, now: float, hooks: FinalizeHooks = ()
) -> BatchRecord:
    """End a batch whose completion window has passed: finished results are kept, every
    unfinished request gets a `batch_expired` line, and the batch ends `expired` (or
    `completed`, if everything had finished in time). The worker aborts the batch's running
    requests first; with no worker, `expire_unattended` calls this. Safe to redo after a crash."""
    rec = await get_batch(store, batch_id)
    if rec.status is not BatchStatus.IN_PROGRESS or not is_expired(rec.status, rec.expires_at, now):
        return rec
    await store.finish_unfinished(batch_id, EXPIRED_RESULT, now)
    return await finalize(store, settings, batch_id, now=now, hooks=hooks)


async def expire_unattended(
    store: Store, settings: Settings, rec: BatchRecord, *, now: float, hooks: FinalizeHooks = ()
) -> BatchRecord:
    """`rec` as a reader should show it: past its window with no worker running, nobody else
    applies the window, so the reader expires it (`status`, GET /v1/batches/{id})."""
    if not is_expired(rec.status, rec.expires_at, now):
        return rec
    if await store.live_workers(now, settings.lease_s):
        return rec  # a worker aborts the batch's running requests, then expires it
    return await expire(store, settings, rec.id, now=now, hooks=hooks)
