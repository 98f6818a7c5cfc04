"""Housekeeping: the worker's rounds besides running requests. Its lease (heartbeats, and the
leases of this host's dead workers ended at once), cancelled and expired batches settled, batches
whose every request is done finalized, expired files deleted.

A batch whose settling or finalize fails for a reason of its own is parked with its own backoff
while the others go on; a transient fault (locked database, full disk) is the tick's."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from batchmlx.batches.files import delete_expired_files
from batchmlx.batches.finalize import FinalizeHooks, finalize
from batchmlx.batches.lifecycle import expire, settle_cancelling
from batchmlx.batches.retention import RetentionSweep
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus, is_expired
from batchmlx.core.records import BatchRecord
from batchmlx.store import Store
from batchmlx.worker.resilience import Backoff, is_transient

log = logging.getLogger("batchmlx.worker")

# finalize, settle_cancelling, expire: (store, settings, batch id, now=, hooks=) -> the batch
_BatchOp = Callable[..., Awaitable[BatchRecord]]


@dataclass(eq=False)
class Housekeeping:
    store: Store
    settings: Settings
    worker_id: str
    clock: Callable[[], float]
    stop_batch: Callable[[str], Awaitable[None]]  # drop a batch's requests (on the engine thread)
    flush: Callable[[], Awaitable[None]]  # write every ready result now
    hooks: FinalizeHooks = ()  # run by each finalize (the inbox's result copies)
    # told of each batch a finalize, cancel or expiry of this worker ended
    on_end: Callable[[BatchRecord], None] | None = None
    _last_beat: float = field(default=-math.inf, init=False)  # the first tick registers us
    # batch -> (retry at, its backoff)
    _parked: dict[str, tuple[float, Backoff]] = field(default_factory=dict, init=False)
    _retention: RetentionSweep = field(default_factory=RetentionSweep, init=False)

    # -- this worker's lease -------------------------------------------------------------------
    async def heartbeat(self, force: bool = False) -> None:
        now = self.clock()
        if force or now - self._last_beat >= self.settings.lease_s / 3:
            lease_s, host = self.settings.lease_s, self.settings.hostname
            await self.store.heartbeat(self.worker_id, now, lease_s, pid=os.getpid(), hostname=host)
            self._last_beat = now
            if self.store.one_host:
                await self._recover_dead_workers()

    async def _recover_dead_workers(self) -> None:
        """Workers of this host whose process is gone (SIGKILL, crash, power loss) hold leases
        nobody renews: end them now instead of waiting `lease_s`."""
        for wid, pid in await self.store.workers_on_host(self.settings.hostname):
            if wid != self.worker_id and pid is not None and not _pid_alive(pid):
                n = await self.store.abandon_worker(wid)
                log.info("worker %s (pid %s) is gone; %d requests claimable again", wid, pid, n)

    # -- batches -------------------------------------------------------------------------------
    async def end_batches(self) -> bool:
        """Settle cancelled batches, expire those past their window, delete expired files."""
        settled = await self.settle_batches()
        expired = await self.expire_batches()
        await delete_expired_files(self.store, now=self.clock())
        await self._retention.run(self.store, self.settings, self.clock())
        return settled or expired

    async def settle_batches(self) -> bool:
        """Cancelled batches: abort their running requests, write their files."""
        due = [b for b in await self.store.batches_with_status(BatchStatus.CANCELLING)
               if not self._is_parked(b.id)]  # fmt: skip
        for b in due:
            await self._end_batch(b.id, "cancel", settle_cancelling)
        return bool(due)

    async def expire_batches(self) -> bool:
        """Batches past their completion window: stop their requests, keep what finished."""
        now = self.clock()
        active = await self.store.active_batches()
        due = [b for b in active if is_expired(b.status, b.expires_at, now)
               and not self._is_parked(b.id)]  # fmt: skip
        for b in due:
            await self._end_batch(b.id, "expiry", expire, now=now)
        return bool(due)

    async def _end_batch(
        self, batch_id: str, what: str, op: _BatchOp, *, now: float | None = None
    ) -> Any:
        """Stop the batch's requests here, write the results already ready, then `op` it."""
        await self.stop_batch(batch_id)
        await self.flush()
        return await self._for_batch(batch_id, what, op, self.clock() if now is None else now)

    async def finalize_ready(self) -> bool:
        ids = [b for b in await self.store.batches_to_finalize() if not self._is_parked(b)]
        for batch_id in ids:
            await self._for_batch(batch_id, "finalize", finalize, self.clock())
        return bool(ids)

    async def _for_batch(self, batch_id: str, what: str, op: _BatchOp, now: float) -> Any:
        """Run one batch's finalize, cancel or expiry. A transient fault is the tick's (backoff,
        retry); any other is this batch's: logged, retried later with its own backoff, while
        the other batches go on. Returns the op's result, or None when it failed."""
        try:
            result = await op(self.store, self.settings, batch_id, now=now, hooks=self.hooks)
        except Exception as exc:
            if is_transient(exc):
                raise
            _, backoff = self._parked.get(batch_id, (0.0, Backoff(first=self.settings.poll_s)))
            delay = backoff.next()
            self._parked[batch_id] = (time.monotonic() + delay, backoff)
            log.error("batch %s: %s failed, retrying in %.1fs; other batches go on",
                      batch_id, what, delay, exc_info=exc)  # fmt: skip
            return None
        self._parked.pop(batch_id, None)
        if self.on_end is not None and isinstance(result, BatchRecord):
            self.on_end(result)
        return result

    def _is_parked(self, batch_id: str) -> bool:
        entry = self._parked.get(batch_id)
        return entry is not None and time.monotonic() < entry[0]


async def running_workers(store: Store, settings: Settings) -> list[str]:
    """Workers with a fresh heartbeat, less those of this host whose process is gone (a
    crashed worker's heartbeat stays fresh for up to `lease_s`: a waiter that trusted it
    would wait on nobody)."""
    live = await store.live_workers(store.clock(), settings.lease_s)
    if not live or not store.one_host:
        return live
    gone = {wid for wid, pid in await store.workers_on_host(settings.hostname)
            if pid is not None and not _pid_alive(pid)}  # fmt: skip
    return [w for w in live if w not in gone]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
