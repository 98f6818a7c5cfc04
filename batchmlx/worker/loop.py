"""The worker: claim many → engine steps → record results → finalize. The composition root.

One asyncio loop, one engine. Engine steps are synchronous and short; between steps the loop
renews leases, writes finished results in one transaction per flush (not one per request), claims
more work while the running batch has room, and settles cancelled batches.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import batchmlx.ingest  # noqa: F401  (registers the inbox's finalize hook)
from batchmlx.batches.files import delete_expired_files
from batchmlx.batches.finalize import finalize
from batchmlx.batches.lifecycle import expire, settle_cancelling
from batchmlx.config import Settings
from batchmlx.core.engine_api import ENGINE_DEFAULTS, EngineSettings
from batchmlx.core.lifecycle import BatchStatus, is_expired
from batchmlx.core.records import ClaimedRequest, RequestResult
from batchmlx.core.width import initial_width
from batchmlx.faults import crash_point
from batchmlx.store import Store
from batchmlx.worker.build import EngineFactory, ServingModel, mlx_engine_factory
from batchmlx.worker.embeddings import EmbeddingJobs, is_embeddings
from batchmlx.worker.metrics import EngineMetrics, register_worker
from batchmlx.worker.online import ONLINE_PRIORITY, OnlineQueue
from batchmlx.worker.resilience import Backoff, is_transient
from batchmlx.worker.translate import (
    PendingRequest,
    parse_choice_id,
    server_error_result,
)

log = logging.getLogger("batchmlx.worker")


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    until_idle: bool = False  # exit once nothing is left to do
    model: str | None = None  # serve only batches of this model (None: whatever comes first)
    dtype: str = "auto"
    engine: EngineSettings = ENGINE_DEFAULTS
    claim_factor: int = 4  # hold up to this many times max_batch_size requests
    flush_s: float = 0.5  # results wait at most this long before their transaction
    max_attempts: int = 3  # claims of one request before it is given up (error file)
    # claim only batches of these models (resolved names as batches record them; "default"
    # covers batches naming none): workers on several hosts may each serve their own models
    only_models: tuple[str, ...] = ()


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
    ) -> None:
        """`engine_factory`: a model name → its engine and translator (default: the MLX
        engine, loaded on first use; tests pass a fake)."""
        self.store = store
        self.settings = settings
        self.opts = options
        self.clock = clock or store.clock  # leases in the database's time (PostgreSQL)
        self.on_progress = on_progress
        self.host = settings.hostname
        self.worker_id = f"w-{self.host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.build = engine_factory or mlx_engine_factory(
            cache_dir=settings.cache_dir, dtype=options.dtype, engine=options.engine
        )
        self.loaded: ServingModel | None = None
        self.pending: dict[int, PendingRequest] = {}  # row id -> request in the engine
        self.online = OnlineQueue()  # the HTTP API's requests, ahead of batch work
        self.online_pending: dict[int, PendingRequest] = {}  # ticket id (< 0) -> request
        self.ready: list[tuple[int, RequestResult]] = []  # results waiting for a flush
        self.embeddings = EmbeddingJobs()  # /v1/embeddings requests for the next batched pass
        self.ready_tokens: dict[str, int] = {}  # batch id -> completion tokens in `ready`
        self.stop_requested = False
        self.metrics = EngineMetrics()  # this process's registry and chart series
        register_worker(self)  # the dashboard and `submit --wait` read inflight_tokens()
        self._last_flush = 0.0
        self._last_beat = -math.inf  # the first tick registers the worker
        self._backoff = Backoff()  # between ticks that failed
        self._parked: dict[str, tuple[float, Backoff]] = {}  # batch -> (retry at, its backoff)
        self._next_housekeeping = 0.0  # monotonic time of the next look for other work
        self._queue_dry = False  # the last claim found nothing: wait for housekeeping

    # -- lifecycle -----------------------------------------------------------------------------
    async def run(self) -> None:
        """Tick until stopped. A tick that fails (locked database, full disk, a bug) is logged
        and retried after a backoff: one bad thing never ends the worker."""
        try:
            while not self.stop_requested:
                if self.online_pending:
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

    async def tick(self) -> bool:
        """One round: returns False when there was nothing to do.

        While the engine runs, the queries that look for other work (cancelled or expired
        batches, finished batches, new requests) run at most every poll_s, not every step:
        they are SQL round trips on the engine's hot path, and claims take the write lock."""
        await self._heartbeat()
        running = self.loaded is not None and self.loaded.engine.has_unfinished()
        now = time.monotonic()
        housekeeping = not running or now >= self._next_housekeeping
        did = False
        if housekeeping:
            self._next_housekeeping = now + self.settings.poll_s
            did |= await self._settle_batches()
            did |= await self._expire_batches()
            await delete_expired_files(self.store, now=self.clock())
        did |= self._admit_online()
        if housekeeping or (len(self.pending) < self._max_batch() and not self._queue_dry):
            claimed = await self._claim()
            self._queue_dry = not claimed
            did |= claimed
        running = self.loaded is not None and self.loaded.engine.has_unfinished()
        if self.embeddings:
            self._run_embeddings()
            did = True
        if running:
            self._step()
        # nothing left to step: write what is ready now rather than wait for the timer
        await self._flush(force=not running)
        if housekeeping or not running:
            did |= await self._finalize_ready()
        return did or running

    # -- online requests -----------------------------------------------------------------------
    def _admit_online(self) -> bool:
        """Admit the server's tickets (priority over batch work); drop abandoned ones."""
        if self.loaded is not None:
            live = set(self.online.live_ids)
            for row in [r for r in self.online_pending if r not in live]:
                p = self.online_pending.pop(row)
                for i in range(p.parsed.n):
                    self.loaded.engine.abort(f"{row}:{i}")
        tickets = self.online.drain()
        if not tickets:
            return False
        try:
            loaded = self._ensure_model(self.loaded.name if self.loaded else self._model_for(None))
        except Exception as exc:
            log.error("online requests: the model could not be loaded", exc_info=exc)
            err = server_error_result(f"The model could not be loaded: {exc}")
            for t in tickets:
                self.online.done(t.id, err.status_code, err.body)
            return True
        for t in tickets:
            t.decode = loaded.translator.tok.decode
            t.model = loaded.translator.model_name
            claimed = ClaimedRequest(
                id=t.id, batch_id="", custom_id="", line=0, endpoint=t.endpoint,
                model=loaded.name, body=t.body, attempts=1,
            )  # fmt: skip
            if is_embeddings(t.endpoint):
                error = self._add_embeddings(loaded, claimed)
                if error is not None:
                    self.online.done(t.id, error.status_code, error.body)
                continue
            pending, gens, error = loaded.translator.prepare(claimed)
            if error is not None:
                self.online.done(t.id, error.status_code, error.body)
                continue
            try:
                for g in gens:
                    g.priority = ONLINE_PRIORITY
                    loaded.engine.add(g)
            except ValueError as exc:
                for g in gens:
                    loaded.engine.abort(g.request_id)
                err = server_error_result(str(exc))
                self.online.done(t.id, err.status_code, err.body)
                continue
            self.online_pending[t.id] = pending
        return True

    def _on_token(self, request_id: str, token_id: int) -> None:
        row, idx = parse_choice_id(request_id)
        if OnlineQueue.owns(row):
            self.online.token(row, idx, token_id)

    # -- claiming ------------------------------------------------------------------------------
    async def _claim(self) -> bool:
        """Top the engine up from the oldest in-progress batches this engine can serve."""
        cap = self.opts.claim_factor * self._max_batch()
        room = cap - len(self.pending)
        if room < self._max_batch():
            return False
        did = False
        for b in await self.store.active_batches():
            if self.opts.only_models and (b.model or self.settings.default_model) not in (
                self.opts.only_models
            ):
                continue  # another worker's model
            model = self._model_for(b.model)
            busy = self.pending or self.online_pending or self.embeddings
            if self.loaded is not None and model != self.loaded.name and busy:
                continue  # one engine holds one model; come back when this one drains
            claimed = await self.store.claim(
                self.worker_id, room, self.clock(), self.settings.lease_s, batch_id=b.id
            )
            if claimed:
                crash_point("after_claim")
            for c in claimed:
                try:
                    self._admit(c)
                except Exception as exc:  # tied to this request (or its batch's model)
                    log.error("request %s of %s could not start", c.custom_id, c.batch_id,
                              exc_info=exc)  # fmt: skip
                    self.ready.append(
                        (c.id, server_error_result(f"The request could not start: {exc}"))
                    )
            room -= len(claimed)
            did |= bool(claimed)
            if room <= 0:
                break
        return did

    def _model_for(self, batch_model: str | None) -> str:
        return self.opts.model or batch_model or self.settings.default_model

    def _admit(self, c: ClaimedRequest) -> None:
        if c.attempts > self.opts.max_attempts:
            # every earlier run of it ended with its worker gone (killed, crashed): stop trying
            message = (
                f"gave up after {c.attempts - 1} attempts: the worker stopped while running "
                "this request each time"
            )
            self.ready.append((c.id, server_error_result(message)))
            return
        loaded = self._ensure_model(self._model_for(c.model))
        if is_embeddings(c.endpoint):
            error = self._add_embeddings(loaded, c)
            if error is not None:
                self.ready.append((c.id, error))
            return
        pending, gens, error = loaded.translator.prepare(c)
        if error is not None:
            self.ready.append((c.id, error))
            return
        try:
            for g in gens:
                loaded.engine.add(g)
        except ValueError as exc:
            for g in gens:
                loaded.engine.abort(g.request_id)
            self.ready.append((c.id, server_error_result(str(exc))))
            return
        self.pending[c.id] = pending

    def load(self, model: str | None = None) -> str:
        """Load the serving model now (the server does, before it listens); returns the name
        response bodies give it."""
        return self._ensure_model(self._model_for(model)).translator.model_name

    def _ensure_model(self, name: str) -> ServingModel:
        if self.loaded is not None and self.loaded.name == name:
            return self.loaded
        if self.pending or self.online_pending:
            raise RuntimeError("cannot switch models while requests run")
        loaded = self.build(name)
        loaded.engine.on_token = self._on_token
        self.loaded = loaded
        return loaded

    def _max_batch(self) -> int:
        """The running width now: the engine's adaptive limit (claims follow it as it grows),
        else the width an engine starts at (not the hard cap: 4 x 256 claimed up front)."""
        limit = getattr(self.loaded.engine, "running_limit", None) if self.loaded else None
        return initial_width(self.opts.engine) if limit is None else limit

    # -- running -------------------------------------------------------------------------------
    def inflight_tokens(self) -> dict[str, int]:
        """Tokens generated so far by batch requests not yet in the store, per batch."""
        engine = self.loaded.engine if self.loaded is not None else None
        so_far = getattr(engine, "generated_so_far", None)
        out = dict(self.ready_tokens)
        if so_far is None:
            return out
        for row, p in self.pending.items():
            n = sum(so_far(f"{row}:{i}") for i in range(p.parsed.n) if i not in p.outputs)
            out[p.claimed.batch_id] = out.get(p.claimed.batch_id, 0) + n
        return out

    def _step(self) -> None:
        loaded = self.loaded
        now = int(self.clock())
        try:
            outputs = loaded.engine.step()
        except Exception as exc:
            self._fail_running(exc)
            return
        for out in outputs:
            row, idx = parse_choice_id(out.request_id)
            table = self.online_pending if OnlineQueue.owns(row) else self.pending
            p = table.get(row)
            if p is None:
                continue  # aborted
            p.outputs[idx] = out
            if not p.done:
                continue
            del table[row]
            result = loaded.translator.result(p, now)
            if table is self.online_pending:
                self.online.done(row, result.status_code, result.body)
                self.metrics.results([result], "online")
            else:
                self.ready.append((row, result))
                b = p.claimed.batch_id
                self.ready_tokens[b] = self.ready_tokens.get(b, 0) + result.completion_tokens
        self.metrics.after_step(loaded.engine, time.time())
        crash_point("mid_generation")

    def _add_embeddings(self, loaded: ServingModel, c: ClaimedRequest) -> RequestResult | None:
        if loaded.embedder is None:
            return server_error_result(f"The model {loaded.name!r} computes no embeddings here.")
        tr = loaded.translator
        return self.embeddings.add(c, tr.tok, tr.context_length, loaded.embedder.dimensions)

    def _run_embeddings(self) -> None:
        """Every waiting embeddings request in one batched pass, before the next engine step."""
        loaded = self.loaded
        assert loaded is not None and loaded.embedder is not None  # set when they were added
        results = self.embeddings.run(loaded.embedder, loaded.translator.model_name)
        for key, result in results:
            if OnlineQueue.owns(key):
                self.online.done(key, result.status_code, result.body)
            else:
                self.ready.append((key, result))

    def _fail_running(self, exc: Exception) -> None:
        """The engine step raised. The requests it ran (the engine says which; all of them if
        it cannot) get a 500 line (batch) or response (online); the others go on."""
        ids = getattr(exc, "request_ids", None)
        rows = None if ids is None else {parse_choice_id(r)[0] for r in ids}
        err = server_error_result(f"The engine failed while running this request: {exc}")
        failed = 0
        for table in (self.pending, self.online_pending):
            for row, p in list(table.items()):
                if rows is not None and row not in rows:
                    continue
                for i in range(p.parsed.n):
                    self.loaded.engine.abort(f"{row}:{i}")
                del table[row]
                failed += 1
                if table is self.online_pending:
                    self.online.done(row, err.status_code, err.body)
                else:
                    self.ready.append((row, err))
        log.error("engine step failed; %d requests failed with it", failed, exc_info=exc)

    async def _flush(self, force: bool = False) -> None:
        now = self.clock()
        if not self.ready or (not force and now - self._last_flush < self.opts.flush_s
                              and len(self.ready) < self._max_batch()):  # fmt: skip
            return
        batch = list(self.ready)
        await self.store.complete(self.worker_id, batch, now)  # may fail: results stay ready
        del self.ready[: len(batch)]
        self.ready_tokens.clear()  # now in the store's usage (a dashboard figure only)
        self.metrics.results(r for _, r in batch)
        crash_point("after_result_write")
        self._last_flush = now
        if self.on_progress:
            self.on_progress()

    async def _heartbeat(self, force: bool = False) -> None:
        now = self.clock()
        if force or now - self._last_beat >= self.settings.lease_s / 3:
            await self.store.heartbeat(
                self.worker_id, now, self.settings.lease_s, pid=os.getpid(), hostname=self.host
            )
            self._last_beat = now
            if self.store.one_host:
                await self._recover_dead_workers()

    async def _recover_dead_workers(self) -> None:
        """Workers of this host whose process is gone (SIGKILL, crash, power loss) hold leases
        nobody renews: end them now instead of waiting `lease_s`."""
        for wid, pid in await self.store.workers_on_host(self.host):
            if wid != self.worker_id and pid is not None and not _pid_alive(pid):
                n = await self.store.abandon_worker(wid)
                log.info("worker %s (pid %s) is gone; %d requests claimable again", wid, pid, n)

    # -- batches -------------------------------------------------------------------------------
    async def _settle_batches(self) -> bool:
        """Cancelled batches: abort their running requests, write their files."""
        did = False
        for b in await self.store.batches_with_status(BatchStatus.CANCELLING):
            if self._is_parked(b.id):
                continue
            self._abort_batch(b.id)
            await self._flush(force=True)
            await self._for_batch(b.id, "cancel", settle_cancelling(
                self.store, self.settings, b.id, now=self.clock()))  # fmt: skip
            did = True
        return did

    async def _expire_batches(self) -> bool:
        """Batches past their completion window: stop their requests, keep what finished."""
        now = self.clock()
        active = await self.store.active_batches()
        due = [b for b in active if is_expired(b.status, b.expires_at, now)
               and not self._is_parked(b.id)]  # fmt: skip
        for b in due:
            self._abort_batch(b.id)
            await self._flush(force=True)
            rec = await self._for_batch(b.id, "expiry", expire(
                self.store, self.settings, b.id, now=now))  # fmt: skip
            if rec is not None:
                log.info("batch %s: completion window ended; %s", b.id, rec.status.value)
        return bool(due)

    def _abort_batch(self, batch_id: str) -> None:
        """Drop the batch's requests from the engine; their leases go with the batch's end."""
        for row, p in list(self.pending.items()):
            if p.claimed.batch_id == batch_id:
                for i in range(p.parsed.n):
                    self.loaded.engine.abort(f"{row}:{i}")
                del self.pending[row]

    async def _finalize_ready(self) -> bool:
        ids = [b for b in await self.store.batches_to_finalize() if not self._is_parked(b)]
        for batch_id in ids:
            await self._for_batch(batch_id, "finalize", finalize(
                self.store, self.settings, batch_id, now=self.clock()))  # fmt: skip
        return bool(ids)

    async def _for_batch(self, batch_id: str, what: str, op: Any) -> Any:
        """Run one batch's finalize, cancel or expiry. A transient fault is the tick's (backoff,
        retry); any other is this batch's: logged, retried later with its own backoff, while
        the other batches go on. Returns the op's result, or None when it failed."""
        try:
            result = await op
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
        return result

    def _is_parked(self, batch_id: str) -> bool:
        entry = self._parked.get(batch_id)
        return entry is not None and time.monotonic() < entry[0]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


async def run_worker(
    settings: Settings,
    options: WorkerOptions,
    *,
    store: Store | None = None,
    on_progress: Callable[[], None] | None = None,
    signals: bool = True,
    inbox: Any = None,
    engine_factory: EngineFactory | None = None,
) -> None:
    """Run a worker until it stops; with `inbox` (an ingest.inbox.Inbox), watch its folder in
    the same event loop and stop watching when the worker stops."""
    own = store is None
    store = store or await Store.from_settings(settings)
    try:
        worker = Worker(
            store, settings, options, on_progress=on_progress, engine_factory=engine_factory
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
