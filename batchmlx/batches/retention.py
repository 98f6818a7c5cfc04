"""How long a finished batch is kept: `purge_finished` removes the batches (completed, failed,
expired, cancelled) that finished more than N days ago, rows and files (`batchmlx purge`, and the
worker's housekeeping under $BATCHMLX_RETENTION_DAYS); `forget_orphaned` drops the contents whose
file is gone (see store/retention.py)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from batchmlx.config import Settings
from batchmlx.store import Store
from batchmlx.store.retention import FinishedBatch, PurgedBatch

log = logging.getLogger("batchmlx.retention")

DAY_S = 86_400.0
SWEEP_S = 600.0  # the worker's retention sweep: at most this often (a read, then short writes)
SWEEP_BATCHES = 50  # batches one sweep purges at most, so a tick stays short; the rest: next tick
RETRY_S = 60.0  # a sweep that failed (a locked or lost database) is tried again this much later


async def forget_orphaned(store: Store, *, file_ids: list[str] | None = None) -> int:
    """Drop the request contents of finished batches whose files are gone (of the batches
    naming `file_ids`, or all); returns the rows changed."""
    return await store.forget_contents(await store.orphaned_contents(file_ids=file_ids))


async def finished_before(store: Store, *, older_than_days: float, now: float,
                          limit: int = 10_000) -> list[FinishedBatch]:  # fmt: skip
    """The finished batches that `purge_finished` would remove now."""
    return await store.finished_before(now - older_than_days * DAY_S, limit=limit)


async def purge_finished(
    store: Store, *, older_than_days: float, now: float, max_batches: int | None = None
) -> list[PurgedBatch]:
    """Remove the batches that finished more than `older_than_days` ago: requests, batch rows,
    file records and bytes (wherever stored), oldest first; at most `max_batches`."""
    purged: list[PurgedBatch] = []
    while max_batches is None or len(purged) < max_batches:
        want = 500 if max_batches is None else min(500, max_batches - len(purged))
        page = await finished_before(store, older_than_days=older_than_days, now=now, limit=want)
        gone = [p for b in page if (p := await _purge(store, b.id)) is not None]
        purged += gone
        if not gone:  # nothing left (or another host purged this page first)
            break
    return purged


async def _purge(store: Store, batch_id: str) -> PurgedBatch | None:
    rec = await store.purge_batch(batch_id)
    for f in rec.files if rec is not None else ():
        await store.delete_file_bytes(f)
    return rec


@dataclass(eq=False)
class RetentionSweep:
    """The worker's retention round, run from its housekeeping at most every SWEEP_S: contents
    whose file is gone dropped (those a crash left between a file's deletion and its rows'),
    and with `settings.retention_days` the batches finished longer ago purged."""

    _next: float = field(default=-math.inf, init=False)

    async def run(self, store: Store, settings: Settings, now: float) -> None:
        if now < self._next:
            return
        self._next = now + SWEEP_S
        try:
            await forget_orphaned(store)
            if settings.retention_days is None:
                return
            purged = await purge_finished(store, older_than_days=settings.retention_days,
                                          now=now, max_batches=SWEEP_BATCHES)  # fmt: skip
        except Exception as exc:  # retention can wait; the worker's work cannot
            self._next = now + RETRY_S
            log.warning("retention sweep failed, retrying in %.0fs: %s", RETRY_S, exc)
            return
        if purged:
            rows = sum(p.requests for p in purged)
            log.info("retention: purged %d batches finished over %g days ago (%d requests)",
                     len(purged), settings.retention_days, rows)  # fmt: skip
        if len(purged) == SWEEP_BATCHES:
            self._next = now  # more are due: the next tick goes on
