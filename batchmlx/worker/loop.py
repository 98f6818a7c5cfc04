"""The worker: claim many → engine steps → record results → finalize. The composition root.

One asyncio loop, one engine. The Worker composes three parts: admission (worker/admission.py:
claimed batch requests and online tickets, through one path), the requests in flight
(worker/inflight.py: the only caller of the engine, all synchronous) and housekeeping
(worker/housekeeping.py: leases, cancels, expiry, finalize). Between engine steps the loop renews
leases, writes finished results in one transaction per flush (not one per request), claims more
work while the running batch has room, and settles cancelled batches.

The seam to the engine is `self.inflight`: `tick` awaits only the store and the online queue,
and calls `inflight` synchronously (admitting, stepping). Issue 21 moves those calls onto the
engine's own thread so that the event loop (HTTP, database) never waits on a step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

from batchmlx.batches.finalize import FinalizeHooks
from batchmlx.config import Settings
from batchmlx.core.width import initial_width
from batchmlx.faults import crash_point
from batchmlx.ingest.inbox import Inbox
from batchmlx.store import Store
from batchmlx.worker.admission import Admission
from batchmlx.worker.build import EngineFactory, ServingModel, mlx_engine_factory
from batchmlx.worker.housekeeping import Housekeeping
from batchmlx.worker.inflight import InFlight
from batchmlx.worker.metrics import register_worker
from batchmlx.worker.online import OnlineQueue
from batchmlx.worker.options import WorkerOptions
from batchmlx.worker.resilience import Backoff, is_transient
from batchmlx.worker.translate import PendingRequest

log = logging.getLogger("batchmlx.worker")


class Worker:
    def __init__(
        self,
        store: Store,
        settings: Settings,
        options: WorkerOptions,
        *,
        clock: Callable[[], float] | None = None,
        on_progress: Callable[[], None] | None = None,
        engine_factory: EngineFactory | None = None,
        finalize_hooks: FinalizeHooks = (),
    ) -> None:
        """`engine_factory`: a model name → its engine and translator (default: the MLX
        engine, loaded on first use; tests pass a fake). `finalize_hooks`: run by each
        finalize this worker does (the CLI and the server pass the inbox's result copies)."""
        self.store = store
        self.settings = settings
        self.opts = options
        self.clock = clock or store.clock  # leases in the database's time (PostgreSQL)
        self.on_progress = on_progress
        self.worker_id = f"w-{settings.hostname}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        build = engine_factory or mlx_engine_factory(
            cache_dir=settings.cache_dir, dtype=options.dtype, engine=options.engine
        )
        self.inflight = InFlight(build, initial_width=initial_width(options.engine),
                                 clock=self.clock)  # fmt: skip
        self.admission = Admission(
            store=store, settings=settings, opts=options, inflight=self.inflight,
            worker_id=self.worker_id, clock=self.clock,
        )  # fmt: skip
        self.housekeeping = Housekeeping(
            store=store, settings=settings, worker_id=self.worker_id, clock=self.clock,
            stop_batch=self.inflight.abort_batch, flush=lambda: self._flush(force=True),
            hooks=tuple(finalize_hooks),
        )  # fmt: skip
        self.stop_requested = False
        register_worker(self)  # the dashboard and `submit --wait` read inflight_tokens()
        self._last_flush = 0.0
        self._backoff = Backoff()  # between ticks that failed
        self._next_housekeeping = 0.0  # monotonic time of the next look for other work
        self._queue_dry = False  # the last claim found nothing: wait for housekeeping

    # -- what the server, the CLI and benchmarks read ------------------------------------------
    @property
    def online(self) -> OnlineQueue:
        """The HTTP API's requests (the supervisor hands a restarted worker the same queue)."""
        return self.inflight.online

    @online.setter
    def online(self, queue: OnlineQueue) -> None:
        self.inflight.online = queue

    @property
    def loaded(self) -> ServingModel | None:
        return self.inflight.loaded

    @property
    def pending(self) -> dict[int, PendingRequest]:
        """Batch requests in the engine, by row id."""
        return self.inflight.pending

    def load(self, model: str | None = None) -> str:
        """Load the serving model now (the server does, before it listens); returns the name
        response bodies give it."""
        return self.admission.load(model)

    def inflight_tokens(self) -> dict[str, int]:
        return self.inflight.inflight_tokens()

    # -- lifecycle -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Tick until stopped. A tick that fails (locked database, full disk, a bug) is logged
        and retried after a backoff: one bad thing never ends the worker."""
        try:
            while not self.stop_requested:
                if self.inflight.online_pending:
                    crash_point("worker_loop")
                try:
                    busy = await self.tick()
                except Exception as exc:
                    await self._pause_after(exc)
                    continue
                self._backoff.reset()
                # a tick between housekeeping rounds may never suspend: let the server's
                # handlers (dashboard polls, API calls) run between engine steps
                await asyncio.sleep(0)
                if not busy:
                    if self.opts.until_idle:
                        break
                    await self._idle()
        finally:
            await self._persist("write results", lambda: self._flush(force=True))
            if self.pending:
                ids = list(self.pending)
                await self._persist("give back leases", lambda: self.store.release(
                    self.worker_id, ids))  # fmt: skip
            await self._persist("deregister", lambda: self.store.remove_worker(self.worker_id))

    async def tick(self) -> bool:
        """One round: returns False when there was nothing to do.

        While the engine runs, the queries that look for other work (cancelled or expired
        batches, finished batches, new requests) run at most every poll_s, not every step:
        they are SQL round trips on the engine's hot path, and claims take the write lock."""
        fl = self.inflight
        await self.housekeeping.heartbeat()
        now = time.monotonic()
        housekeeping = not fl.running or now >= self._next_housekeeping
        did = False
        if housekeeping:
            self._next_housekeeping = now + self.settings.poll_s
            did |= await self.housekeeping.end_batches()
        did |= self.admission.admit_online()
        if housekeeping or (len(fl.pending) < fl.max_batch and not self._queue_dry):
            claimed = await self.admission.claim()
            self._queue_dry = not claimed
            did |= claimed
        running = fl.running
        if fl.embeddings:
            fl.run_embeddings()
            did = True
        if running:
            fl.step()
        # nothing left to step: write what is ready now rather than wait for the timer
        await self._flush(force=not running)
        if housekeeping or not running:
            did |= await self.housekeeping.finalize_ready()
        return did or running

    async def _flush(self, force: bool = False) -> None:
        now = self.clock()
        ready = self.inflight.ready
        if not ready or (not force and now - self._last_flush < self.opts.flush_s
                         and len(ready) < self.inflight.max_batch):  # fmt: skip
            return
        batch = list(ready)
        await self.store.complete(self.worker_id, batch, now)  # may fail: results stay ready
        self.inflight.written(len(batch))
        self.inflight.metrics.results(r for _, r in batch)
        crash_point("after_result_write")
        self._last_flush = now
        if self.on_progress:
            self.on_progress()

    async def _pause_after(self, exc: Exception) -> None:
        delay = self._backoff.next()
        if is_transient(exc):
            log.warning("transient fault, retrying in %.1fs: %s", delay, exc)
        else:
            log.error("worker tick failed, retrying in %.1fs", delay, exc_info=exc)
        await self._sleep(delay)

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but wake for a stop request (a backoff must not delay SIGTERM)."""
        end = time.monotonic() + seconds
        while not self.stop_requested and (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.1))

    async def _persist(self, what: str, op: Callable[[], Any], tries: int = 5) -> None:
        """At shutdown: retry a transient failure a few times; past that, leases run out."""
        backoff = Backoff()
        for attempt in range(tries):
            try:
                await op()
                return
            except Exception as exc:
                if not is_transient(exc) or attempt == tries - 1:
                    log.error("at shutdown, could not %s", what, exc_info=exc)
                    return
                await asyncio.sleep(backoff.next())

    async def _idle(self) -> None:
        """Nothing to do: wait for an online request or new work. On PostgreSQL a NOTIFY
        wakes the worker (no polling); it also wakes when the first running lease ends (a dead
        worker's requests to take over) and to heartbeat."""
        if not self.store.listens:
            await self.online.wait(self.settings.poll_s)
            return
        timeout = self.settings.lease_s / 3
        lease_end = await self.store.next_lease_end()
        if lease_end is not None:
            timeout = min(timeout, max(lease_end - self.clock(), 0.0) + 0.05)
        waits = [
            asyncio.ensure_future(self.online.wait(timeout)),
            asyncio.ensure_future(self.store.wait_for_work(timeout)),
        ]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    def install_signal_handlers(self) -> None:
        """First SIGTERM/SIGINT: finish the current step, release leases, exit. Second: now."""
        loop = asyncio.get_running_loop()

        def handler() -> None:
            if self.stop_requested:
                os._exit(130)
            self.stop_requested = True

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, handler)


async def run_worker(
    settings: Settings,
    options: WorkerOptions,
    *,
    store: Store | None = None,
    on_progress: Callable[[], None] | None = None,
    signals: bool = True,
    inbox: Inbox | None = None,
    engine_factory: EngineFactory | None = None,
    finalize_hooks: FinalizeHooks = (),
) -> None:
    """Run a worker until it stops; with `inbox`, watch its folder in the same event loop and
    stop watching when the worker stops. `finalize_hooks`: as Worker's."""
    own = store is None
    store = store or await Store.from_settings(settings)
    try:
        worker = Worker(
            store, settings, options, on_progress=on_progress, engine_factory=engine_factory,
            finalize_hooks=finalize_hooks,
        )
        if signals:
            worker.install_signal_handlers()
        if inbox is None:
            await worker.run()
            return
        stop = asyncio.Event()
        watcher = asyncio.create_task(inbox.run(store, stop))
        try:
            await worker.run()
        finally:
            stop.set()
            await watcher
    finally:
        if own:
            await store.close()
