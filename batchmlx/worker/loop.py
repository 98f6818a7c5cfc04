"""The worker: claim many → engine steps → record results → finalize. The composition root.

One asyncio loop, one engine. Engine steps are synchronous and short; between steps the loop
renews leases, writes finished results in one transaction per flush (not one per request), claims
more work while the running batch has room, and settles cancelled batches.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchmlx import service
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus, is_expired
from batchmlx.core.records import ClaimedRequest, RequestResult
from batchmlx.faults import crash_point
from batchmlx.store import Store
from batchmlx.worker.embeddings import EmbeddingJobs, is_embeddings
from batchmlx.worker.online import ONLINE_PRIORITY, OnlineQueue
from batchmlx.worker.translate import (
    PendingRequest,
    Translator,
    parse_choice_id,
    server_error_result,
)

log = logging.getLogger("batchmlx.worker")


@dataclass(frozen=True, slots=True)
class WorkerOptions:
    until_idle: bool = False  # exit once nothing is left to do
    model: str | None = None  # serve only batches of this model (None: whatever comes first)
    dtype: str = "auto"
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields
    claim_factor: int = 4  # hold up to this many times max_batch_size requests
    flush_s: float = 0.5  # results wait at most this long before their transaction
    max_attempts: int = 3  # claims of one request before it is given up (error file)


@dataclass
class _Loaded:
    name: str
    engine: Any
    translator: Translator


class Worker:
    def __init__(
        self,
        store: Store,
        settings: Settings,
        options: WorkerOptions,
        *,
        clock: Callable[[], float] = time.time,
        on_progress: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.opts = options
        self.clock = clock
        self.on_progress = on_progress
        self.worker_id = f"w-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.loaded: _Loaded | None = None
        self.pending: dict[int, PendingRequest] = {}  # row id -> request in the engine
        self.online = OnlineQueue()  # the HTTP API's requests, ahead of batch work
        self.online_pending: dict[int, PendingRequest] = {}  # ticket id (< 0) -> request
        self.ready: list[tuple[int, RequestResult]] = []  # results waiting for a flush
        self.embeddings = EmbeddingJobs()  # /v1/embeddings requests for the next batched pass
        self.stop_requested = False
        self._last_flush = 0.0
        self._last_beat = 0.0
        self._next_housekeeping = 0.0  # monotonic time of the next look for other work
        self._queue_dry = False  # the last claim found nothing: wait for housekeeping

    # -- lifecycle -----------------------------------------------------------------------------
    async def run(self) -> None:
        await self._heartbeat(force=True)
        try:
            while not self.stop_requested:
                busy = await self.tick()
                if not busy:
                    if self.opts.until_idle:
                        break
                    await self.online.wait(self.settings.poll_s)
        finally:
            await self._flush(force=True)
            if self.pending:
                await self.store.release(self.worker_id, list(self.pending))
            await self.store.remove_worker(self.worker_id)

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
            await service.delete_expired_files(self.store, now=self.clock())
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
        if self.loaded is None:
            self._ensure_model(self._model_for(None))
        loaded = self.loaded
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
            model = self._model_for(b.model)
            busy = self.pending or self.online_pending
            if self.loaded is not None and model != self.loaded.name and busy:
                continue  # one engine holds one model; come back when this one drains
            claimed = await self.store.claim(
                self.worker_id, room, self.clock(), self.settings.lease_s, batch_id=b.id
            )
            if claimed:
                crash_point("after_claim")
            for c in claimed:
                self._admit(c)
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

    def _ensure_model(self, name: str) -> _Loaded:
        if self.loaded is not None and self.loaded.name == name:
            return self.loaded
        if self.pending or self.online_pending:
            raise RuntimeError("cannot switch models while requests run")
        from batchmlx.worker.build import build_engine

        engine, translator = build_engine(
            name, cache_dir=self.settings.cache_dir, dtype=self.opts.dtype, **self.opts.engine
        )
        engine.on_token = self._on_token
        self.loaded = _Loaded(name, engine, translator)
        return self.loaded

    def _max_batch(self) -> int:
        if self.opts.engine.get("simple"):
            return 1
        return int(self.opts.engine.get("max_batch_size", 32))

    # -- running -------------------------------------------------------------------------------
    def _step(self) -> None:
        loaded = self.loaded
        now = int(self.clock())
        for out in loaded.engine.step():
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
            else:
                self.ready.append((row, result))
        crash_point("mid_generation")

    def _add_embeddings(self, loaded: _Loaded, c: ClaimedRequest) -> RequestResult | None:
        tr = loaded.translator
        dims = loaded.engine.embedder.dimensions
        return self.embeddings.add(c, tr.tok, tr.context_length, dims)

    def _run_embeddings(self) -> None:
        """Every waiting embeddings request in one batched pass, before the next engine step."""
        loaded = self.loaded
        results = self.embeddings.run(loaded.engine.embedder, loaded.translator.model_name)
        for key, result in results:
            if OnlineQueue.owns(key):
                self.online.done(key, result.status_code, result.body)
            else:
                self.ready.append((key, result))

    async def _flush(self, force: bool = False) -> None:
        now = self.clock()
        if not self.ready or (not force and now - self._last_flush < self.opts.flush_s
                              and len(self.ready) < self._max_batch()):  # fmt: skip
            return
        batch, self.ready = self.ready, []
        await self.store.complete(self.worker_id, batch, now)
        crash_point("after_result_write")
        self._last_flush = now
        if self.on_progress:
            self.on_progress()

    async def _heartbeat(self, force: bool = False) -> None:
        now = self.clock()
        if force or now - self._last_beat >= self.settings.lease_s / 3:
            await self.store.heartbeat(self.worker_id, now, self.settings.lease_s, pid=os.getpid())
            self._last_beat = now
            await self._recover_dead_workers()

    async def _recover_dead_workers(self) -> None:
        """Workers of this host whose process is gone (SIGKILL, crash, power loss) hold leases
        nobody renews: end them now instead of waiting `lease_s`."""
        for wid, pid in await self.store.workers_on_host(socket.gethostname()):
            if wid != self.worker_id and pid is not None and not _pid_alive(pid):
                n = await self.store.abandon_worker(wid)
                log.info("worker %s (pid %s) is gone; %d requests claimable again", wid, pid, n)

    # -- batches -------------------------------------------------------------------------------
    async def _settle_batches(self) -> bool:
        """Cancelled batches: abort their running requests, write their files."""
        did = False
        for b in await self.store.batches_with_status(BatchStatus.CANCELLING):
            self._abort_batch(b.id)
            await self._flush(force=True)
            await service.settle_cancelling(self.store, self.settings, b.id, now=self.clock())
            did = True
        return did

    async def _expire_batches(self) -> bool:
        """Batches past their completion window: stop their requests, keep what finished."""
        now = self.clock()
        active = await self.store.active_batches()
        due = [b for b in active if is_expired(b.status, b.expires_at, now)]
        for b in due:
            self._abort_batch(b.id)
            await self._flush(force=True)
            rec = await service.expire(self.store, self.settings, b.id, now=now)
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
        ids = await self.store.batches_to_finalize()
        for batch_id in ids:
            await service.finalize(self.store, self.settings, batch_id, now=self.clock())
        return bool(ids)


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
) -> None:
    """Run a worker until it stops; with `inbox` (an ingest.inbox.Inbox), watch its folder in
    the same event loop and stop watching when the worker stops."""
    own = store is None
    store = store or await Store.open(settings.db_path)
    try:
        worker = Worker(store, settings, options, on_progress=on_progress)
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
