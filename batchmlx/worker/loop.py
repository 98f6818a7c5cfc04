"""The worker: claim many → engine steps → record results → finalize. The composition root.

One asyncio loop, one engine thread. The Worker composes three parts: admission
(worker/admission.py: claimed batch requests and online tickets, through one path), the requests
in flight (worker/inflight.py: the only caller of the engine, all synchronous) and housekeeping
(worker/housekeeping.py: leases, cancels, expiry, finalize). Between engine steps the loop writes
finished results in one transaction per flush (not one per request), claims more work while the
running batch has room, and settles cancelled batches.

The seam to the engine is `self.inflight`, and every call into it that touches the engine runs
on `self.engine`, the engine's own thread (worker/engine_thread.py): a tick hands it one round
(admit what was claimed, run the embeddings pass, step) and awaits the round, so the event loop
(HTTP handlers, the database, signals) never waits on a step. While a round runs the loop keeps
this worker's leases renewed, and a stop is seen at once: the round's results are written, then
the leases given back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from batchmlx.batches.finalize import FinalizeHooks
from batchmlx.config import Settings
from batchmlx.core.records import ClaimedRequest
from batchmlx.core.width import initial_width
from batchmlx.faults import crash_point
from batchmlx.ingest.inbox import Inbox
from batchmlx.store import Store
from batchmlx.worker.admission import Admission
from batchmlx.worker.build import EngineFactory, ServingModel, mlx_engine_factory
from batchmlx.worker.engine_thread import EngineThread
from batchmlx.worker.housekeeping import Housekeeping
from batchmlx.worker.inflight import InFlight
from batchmlx.worker.journal import Journal
from batchmlx.worker.metrics import register_worker
from batchmlx.worker.online import OnlineQueue, OnlineTicket
from batchmlx.worker.options import WorkerOptions
from batchmlx.worker.resilience import Backoff, is_transient
from batchmlx.worker.translate import PendingRequest

log = logging.getLogger("batchmlx.worker")

T = TypeVar("T")

IDLE_RELEASE_S = 2.0  # idle this long after work: its freed memory goes back to the OS


@dataclass(slots=True)
class _Round:
    """What the loop hands the engine thread for one round."""

    tickets: list[OnlineTicket] = field(default_factory=list)  # online requests to admit
    live: set[int] = field(default_factory=set)  # tickets still wanted (the rest are aborted)
    claimed: list[ClaimedRequest] = field(default_factory=list)  # leased rows to start


@dataclass(frozen=True, slots=True)
class _Ran:
    """What one round did."""

    embedded: bool  # an embeddings pass ran
    stepped: bool  # an engine step ran
    read: bool = False  # requests whose media were read (worker/media_pool.py) were admitted


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
            cache_dir=settings.cache_dir,
            dtype=options.dtype,
            engine=options.engine,
            host=settings.cpu,
            media=settings.media,
        )
        self.engine = EngineThread()  # every call into the engine runs there
        self.inflight = InFlight(build, initial_width=initial_width(options.engine),
                                 clock=self.clock)  # fmt: skip
        self.admission = Admission(
            store=store, settings=settings, opts=options, inflight=self.inflight,
            worker_id=self.worker_id, clock=self.clock,
        )  # fmt: skip
        self.journal = Journal(store, self.inflight.inflight_tokens, options.progress_every_s)
        self.housekeeping = Housekeeping(
            store=store, settings=settings, worker_id=self.worker_id, clock=self.clock,
            stop_batch=lambda b: self.engine.call(self.inflight.abort_batch, b),
            flush=lambda: self._flush(force=True),
            hooks=tuple(finalize_hooks), on_end=self.journal.ended,
        )  # fmt: skip
        self._stop = asyncio.Event()  # set by a stop: wakes the idle wait and backoffs at once
        # a request's media were read (on a fetch thread): wakes the idle wait to admit it
        self._media_read = asyncio.Event()
        self.inflight.media.on_done = lambda: self.inflight.post(self._media_read.set)
        register_worker(self)  # the dashboard and `submit --wait` read inflight_tokens()
        self._last_flush = 0.0
        self._backoff = Backoff()  # between ticks that failed
        self._next_housekeeping = 0.0  # monotonic time of the next look for other work
        self._queue_dry = False  # the last claim found nothing: wait for housekeeping
        self._hurried = False  # the last tick put its housekeeping off for online requests
        self._busy_at: float | None = None  # monotonic time of the last busy tick, unreleased

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
        """Load the serving model now, on the engine thread, blocking the caller (benchmarks,
        before the worker runs); returns the name response bodies give it."""
        return self.engine.call_blocking(self.admission.load, model)

    async def load_async(self, model: str | None = None) -> str:
        """`load` without blocking the event loop (the server loads before it listens)."""
        return await self.engine.call(self.admission.load, model)

    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    @stop_requested.setter
    def stop_requested(self, value: bool) -> None:
        """A stop (SIGTERM, the server's shutdown): the running round ends, its results are
        written, the leases given back. Set on the event loop's thread."""
        if value:
            self._stop.set()
        else:
            self._stop.clear()

    def inflight_tokens(self) -> dict[str, int]:
        return self.inflight.inflight_tokens()

    # -- lifecycle -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Tick until stopped. A tick that fails (locked database, full disk, a bug), or an
        idle wait that does, is logged and retried after a backoff: one bad thing never ends
        the worker."""
        self.inflight.media.open()
        try:
            while not self.stop_requested:
                if self.inflight.online_pending:
                    crash_point("worker_loop")
                try:
                    busy = await self.tick()
                    if busy:
                        self._busy_at = time.monotonic()
                    else:
                        if self.opts.until_idle and not self.inflight.media:
                            break
                        await self._release_when_idle()
                        await self._idle()
                except Exception as exc:
                    await self._pause_after(exc)
                    continue
                self._backoff.reset()
                # a tick between housekeeping rounds may never suspend: let the server's
                # handlers (dashboard polls, API calls) run between engine steps
                await asyncio.sleep(0)
        finally:
            await self._persist("write results", lambda: self._flush(force=True))
            # reads under way end (their sockets shut); their rows go back with the leases
            # (off the loop: it waits up to 2 s for the fetch threads; a round may still run)
            await self._persist(
                "stop media reads", lambda: asyncio.to_thread(self.inflight.media.close)
            )
            # every lease still held: requests in the engine, embeddings not yet run
            await self._persist("give back leases", lambda: self.store.release(self.worker_id))
            await self._persist("deregister", lambda: self.store.remove_worker(self.worker_id))
            self.engine.close()

    async def tick(self) -> bool:
        """One round: returns False when there was nothing to do.

        While the engine runs, the queries that look for other work (cancelled or expired
        batches, finished batches, new requests) run at most every poll_s, not every step:
        they are SQL round trips on the engine's hot path, and claims take the write lock."""
        fl = self.inflight
        await self.housekeeping.heartbeat()
        now = time.monotonic()
        # online requests wait (they came during the last round): their round starts at once,
        # and the looks for other work and the claim (5-15 ms under a batch, issue 49) wait
        # for the next tick, never two ticks in a row
        hurry = bool(fl.online) and not self._hurried
        self._hurried = hurry
        housekeeping = not hurry and (not fl.running or now >= self._next_housekeeping)
        did = False
        if housekeeping:
            self._next_housekeeping = now + self.settings.poll_s
            did |= await self.housekeeping.end_batches()
            await self.journal.progress()
        work = _Round()
        if not self.stop_requested:  # a stopping worker takes nothing new
            work.tickets = fl.online.drain()
            more = not hurry and len(fl.pending) < fl.max_batch and not self._queue_dry
            if housekeeping or more:
                work.claimed = await self.admission.claim()
                self._queue_dry = not work.claimed
                await self.journal.claimed(work.claimed)
        work.live = set(fl.online.live_ids)
        ran = _Ran(embedded=False, stepped=False)
        if (work.tickets or work.claimed or fl.embeddings or fl.running or fl.online_pending
                or fl.media.has_done or fl.reads_abandoned(work.live)):  # fmt: skip
            ran = await self._on_engine(self._engine_round, work)
        did |= bool(work.tickets or work.claimed) or ran.embedded or ran.read
        # nothing left to step: write what is ready now rather than wait for the timer
        await self._flush(force=not ran.stepped)
        if housekeeping or not ran.stepped:
            did |= await self.housekeeping.finalize_ready()
        return did or ran.stepped

    def _engine_round(self, work: _Round) -> _Ran:
        """On the engine thread: admit (requests whose media were read, then new ones), run
        the embeddings pass, step."""
        fl = self.inflight
        self.admission.admit_tickets(work.tickets, work.live)
        read = fl.admit_read()
        self.admission.admit_claimed(work.claimed)
        stepped, embedded = fl.running, bool(fl.embeddings)
        if embedded:
            fl.run_embeddings()
        if stepped:
            fl.step()
        return _Ran(embedded=embedded, stepped=stepped, read=read)

    async def _on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn` on the engine thread; meanwhile keep this worker's leases renewed (a long
        step or embeddings pass must not let them run out and the rows be claimed again)."""
        self.inflight.post.bind()
        call = asyncio.ensure_future(self.engine.call(fn, *args))
        try:
            while True:
                done, _ = await asyncio.wait({call}, timeout=self.settings.lease_s / 6)
                if done:
                    return call.result()
                try:
                    await self.housekeeping.heartbeat()
                except Exception as exc:  # the next beat may succeed; the lease has slack
                    log.warning("heartbeat during an engine step failed: %s", exc)
        except asyncio.CancelledError:
            call.cancel()
            raise

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
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), seconds)

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

    async def _release_when_idle(self) -> None:
        """Idle for IDLE_RELEASE_S since the last work: the memory it freed goes back to the OS
        (MLX's buffer cache, the heap's free pages), once; a pause between requests keeps it."""
        if self._busy_at is not None and time.monotonic() - self._busy_at >= IDLE_RELEASE_S:
            self._busy_at = None
            await self._on_engine(self.inflight.release_memory)

    async def _idle(self) -> None:
        """Nothing to do: wait for an online request, new work or a stop. On PostgreSQL a
        NOTIFY wakes the worker (no polling); it also wakes when the first running lease of a
        batch it serves ends (a dead worker's requests to take over) and to heartbeat."""
        timeout = self.settings.poll_s
        if self.store.listens:
            timeout = self.settings.lease_s / 3
            lease_end = await self.store.next_lease_end(
                self.opts.only_models, self.settings.default_model
            )
            if lease_end is not None:
                left = lease_end - self.clock()
                # already ended: the claim just made could not take it, so do not spin on it
                timeout = min(timeout, left + 0.05 if left > 0 else self.settings.poll_s)
        self._media_read.clear()
        if self.inflight.media.has_done:  # read since the round: admit it now
            return
        waits: list[asyncio.Future[Any]] = [
            asyncio.ensure_future(self.online.wait(timeout)),
            asyncio.ensure_future(self._stop.wait()),
            asyncio.ensure_future(self._media_read.wait()),
        ]
        if self.store.listens:
            waits.append(asyncio.ensure_future(self.store.wait_for_work(timeout)))
        try:
            await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
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
            store,
            settings,
            options,
            on_progress=on_progress,
            engine_factory=engine_factory,
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
