"""The requests in the engine: the worker's one synchronous seam.

Every call into the engine (building it, add, abort, step, the embeddings pass) is made by
`InFlight`, and none of its methods awaits. The async worker (worker/loop.py: the database, the
HTTP API's tickets, timers) runs them on the engine's own thread (worker/engine_thread.py), one
call at a time, and touches `pending` and `ready` only between those calls. What the online
queue must hear meanwhile (tokens, finished tickets: asyncio objects of the loop) goes through
`post`, which hands it to the loop's thread.

A request whose https or file images must be read first waits in `media` (worker/media_pool.py:
a few fetch threads, bounded) rather than in the engine; a later round takes it from there
(`admit_read`) and it enters the engine as any other, so no fetch runs on the engine's thread.

Requests are keyed by row id: queue rows (> 0) and online tickets (< 0, OnlineQueue.owns) share
one engine; choice i of a request is the engine request `choice_id(row, i)`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from batchmlx.core.engine_api import EngineProtocol, StepError
from batchmlx.core.records import ClaimedRequest, RequestResult
from batchmlx.faults import crash_point
from batchmlx.formats.request import ParsedRequest
from batchmlx.worker.build import EngineFactory, ServingModel
from batchmlx.worker.embeddings import EmbeddingJobs, is_embeddings
from batchmlx.worker.engine_thread import Poster
from batchmlx.worker.media import MediaRefused
from batchmlx.worker.media_pool import MediaPool
from batchmlx.worker.metrics import EngineMetrics
from batchmlx.worker.online import ONLINE_PRIORITY, OnlineQueue
from batchmlx.worker.translate import (
    PendingRequest,
    choice_id,
    error_result,
    parse_choice_id,
    server_error_result,
)

# what an online request gets when the media pool is full (a batch row waits for room instead)
MEDIA_BUSY = "Too many requests here are waiting for their images to be fetched; retry shortly."
# a model that failed to load is not tried again for this long: every line of its batch gets
# the same answer at once, rather than one conversion attempt and one traceback per line
RETRY_LOAD_S = 60.0

log = logging.getLogger("batchmlx.worker")


class ModelUnavailable(Exception):
    """The model a request needs cannot be loaded here (its message says why, in one line)."""


class InFlight:
    """One loaded model and the requests running in it, batch and online alike."""

    def __init__(
        self, build: EngineFactory, *, initial_width: int, clock: Callable[[], float]
    ) -> None:
        """`initial_width`: the width claims follow before an engine is loaded."""
        self.build = build
        self.initial_width = initial_width
        self.clock = clock
        self.loaded: ServingModel | None = None
        self.pending: dict[int, PendingRequest] = {}  # row id -> request in the engine
        self.online_pending: dict[int, PendingRequest] = {}  # ticket id (< 0) -> request
        self.online = OnlineQueue()  # the HTTP API's requests, ahead of batch work
        self.embeddings = EmbeddingJobs()  # /v1/embeddings requests for the next batched pass
        self.ready: list[tuple[int, RequestResult]] = []  # batch results waiting for a flush
        self.ready_tokens: dict[str, int] = {}  # batch id -> completion tokens in `ready`
        self.metrics = EngineMetrics()  # this process's registry and chart series
        self.post = Poster()  # engine thread -> the loop that owns `online`
        self.media = MediaPool()  # requests whose media are read before they enter the engine
        self.unloadable: dict[str, tuple[float, str]] = {}  # model -> (when it failed, why)

    # -- the model -----------------------------------------------------------------------------
    def ensure_model(self, name: str) -> ServingModel:
        if self.loaded is not None and self.loaded.name == name:
            return self.loaded
        if self.pending or self.online_pending or self.media:
            raise RuntimeError("cannot switch models while requests run")
        failed = self.unloadable.get(name)
        if failed is not None and self.clock() - failed[0] < RETRY_LOAD_S:
            raise ModelUnavailable(failed[1])
        try:
            loaded = self.build(name)
        except Exception as exc:
            why = f"the model {name!r} cannot be loaded: {exc}"
            # once per model and RETRY_LOAD_S; the traceback only for what is no known refusal
            known = isinstance(exc, (OSError, ValueError))
            log.error("%s", why, exc_info=None if known else exc)
            self.unloadable[name] = (self.clock(), why)
            raise ModelUnavailable(why) from None
        self.unloadable.pop(name, None)
        loaded.engine.on_token = self._on_token
        self.loaded = loaded
        return loaded

    @property
    def engine(self) -> EngineProtocol:
        assert self.loaded is not None  # requests run only in a loaded engine
        return self.loaded.engine

    @property
    def max_batch(self) -> int:
        """The running width now: the engine's adaptive limit (claims follow it as it grows),
        else the width an engine starts at (not the hard cap: 4 x 256 claimed up front)."""
        return self.initial_width if self.loaded is None else self.loaded.engine.running_limit

    @property
    def running(self) -> bool:
        """The engine has requests to step."""
        return self.loaded is not None and self.loaded.engine.has_unfinished()

    @property
    def busy(self) -> bool:
        """Requests of the loaded model wait or run (it cannot be switched now)."""
        return bool(self.pending or self.online_pending or self.embeddings or self.media)

    # -- in and out ----------------------------------------------------------------------------
    def start(self, loaded: ServingModel, c: ClaimedRequest) -> RequestResult | None:
        """The one way a request (a claimed row or an online ticket) enters the engine, or the
        embeddings pass; returns the result it gets instead when it cannot run (a 400, a 500)."""
        if is_embeddings(c.endpoint):
            if loaded.embedder is None:
                return server_error_result(
                    f"The model {loaded.name!r} computes no embeddings here."
                )
            return self.embeddings.add(c, loaded.translator, loaded.embedder.dimensions)
        parsed = loaded.translator.check(c)
        if isinstance(parsed, RequestResult):
            return parsed
        if loaded.translator.reads_media(parsed):  # read on the media pool, not here
            if self.media.submit(c, parsed, loaded.translator.media):
                return None
            return server_error_result(MEDIA_BUSY, status_code=503)
        return self._enter(loaded, c, parsed)

    def admit_read(self) -> bool:
        """The requests whose media were read since the last round enter the engine (or get
        their 400: a part refused); returns whether there were any."""
        jobs = self.media.take_done()
        for job in jobs:
            c, outcome = job.claimed, job.outcome
            try:
                if isinstance(outcome, MediaRefused):
                    error: RequestResult | None = error_result(outcome.error)
                elif isinstance(outcome, tuple):
                    assert self.loaded is not None  # busy: the model stayed
                    error = self._enter(self.loaded, c, replace(job.parsed, media=outcome))
                else:
                    error = server_error_result(f"The request's media could not be read: {outcome}")
            except Exception as exc:  # this request's 500; the rest taken go on (each ends once)
                log.error("request %s could not start", c.id, exc_info=exc)
                error = server_error_result(f"The request could not start: {exc}")
            if error is not None:
                self.deliver(c.id, error)
        return bool(jobs)

    def _enter(
        self, loaded: ServingModel, c: ClaimedRequest, parsed: ParsedRequest
    ) -> RequestResult | None:
        pending, gens, error = loaded.translator.prepare(c, parsed)
        if error is not None:
            return error
        assert pending is not None  # prepare returns one or the other
        try:
            for g in gens:
                # online tickets: ONLINE_PRIORITY; batch lines: their batch's (admission.py)
                g.priority = ONLINE_PRIORITY if OnlineQueue.owns(c.id) else c.priority
                loaded.engine.add(g)
        except ValueError as exc:
            self._abort_choices(c.id, len(gens))
            return server_error_result(str(exc))
        self._table(c.id)[c.id] = pending
        return None

    def deliver(self, row: int, result: RequestResult) -> None:
        """A request's end: its ticket answered (online) or its result kept for the next flush."""
        if OnlineQueue.owns(row):
            self.post(self.online.done, row, result.status_code, result.body)
        else:
            self.ready.append((row, result))

    def abort(self, row: int) -> PendingRequest | None:
        """Take a request out of the engine (every choice of it) and out of its table, or out
        of the media pool (its fetch under way ended)."""
        self.media.cancel(row)
        p = self._table(row).pop(row, None)
        if p is not None:
            self._abort_choices(row, p.parsed.n)
        return p

    def abort_batch(self, batch_id: str) -> None:
        """Drop the batch's requests from the engine; their leases go with the batch's end."""
        for row in [r for r, p in self.pending.items() if p.claimed.batch_id == batch_id]:
            self.abort(row)
        for row in [j.row for j in self.media.jobs() if j.claimed.batch_id == batch_id]:
            self.media.cancel(row)

    def drop_abandoned(self, live: set[int]) -> None:
        """Abort the online requests whose client went away (their tickets are not in `live`,
        the online queue's live ids, read on the loop)."""
        for row in [r for r in self.online_pending if r not in live]:
            self.abort(row)
        for row in [j.row for j in self.media.jobs() if OnlineQueue.owns(j.row)
                    and j.row not in live]:  # fmt: skip
            self.media.cancel(row)

    def reads_abandoned(self, live: set[int]) -> bool:
        """An online request whose media are read lost its client (a round drops it)."""
        return any(OnlineQueue.owns(j.row) and j.row not in live for j in self.media.jobs())

    def written(self, n: int) -> None:
        """The first `n` ready results are in the store."""
        del self.ready[:n]
        self.ready_tokens.clear()  # now in the store's usage (a dashboard figure only)

    # -- running -------------------------------------------------------------------------------
    def step(self) -> None:
        """One engine step; the requests it finished are delivered."""
        loaded = self.loaded
        assert loaded is not None
        now = int(self.clock())
        try:
            outputs = loaded.engine.step()
        except Exception as exc:
            self._fail_running(exc)
            return
        if loaded.threads is not None:
            loaded.threads.review()  # a neighbour that came or went since the last look
        for out in outputs:
            row, idx = parse_choice_id(out.request_id)
            p = self._table(row).get(row)
            if p is None:
                continue  # aborted
            p.outputs[idx] = out
            if not p.done:
                continue
            del self._table(row)[row]
            result = loaded.translator.result(p, now)
            self.deliver(row, result)
            if OnlineQueue.owns(row):
                self.metrics.results([result], "online")
            else:
                b = p.claimed.batch_id
                self.ready_tokens[b] = self.ready_tokens.get(b, 0) + result.completion_tokens
        preempted = self.metrics.series.latest.preemptions
        self.metrics.after_step(loaded.engine, time.time())
        crash_point("mid_generation")
        if self.metrics.series.latest.preemptions > preempted:
            crash_point("after_preemption")

    def run_embeddings(self) -> None:
        """One bounded slice of the waiting embeddings requests, before the next engine step."""
        loaded = self.loaded
        assert loaded is not None and loaded.embedder is not None  # set when they were added
        for key, result in self.embeddings.run(loaded.embedder, loaded.translator.model_name):
            self.deliver(key, result)
        if self.embeddings.large_wave_ended:
            self.embeddings.large_wave_ended = False
            self.release_memory()

    def release_memory(self) -> None:
        """On the engine thread: what the engine's work freed, back to the OS (a large one-off
        embeddings wave ended, or the worker went idle)."""
        release = getattr(self.loaded and self.loaded.engine, "release_memory", None)
        if release is not None:  # test doubles have none
            log.info("freed memory released: %.0f MB of MLX's buffer cache", release() / 2**20)

    def inflight_tokens(self) -> dict[str, int]:
        """Tokens generated so far by batch requests not yet in the store, per batch."""
        # read on the loop while the engine thread may step: copies (one C call each, so the
        # GIL makes them whole), and a figure a step changed meanwhile is only a moment old
        out = dict(self.ready_tokens)
        if self.loaded is None:
            return out
        so_far = self.loaded.engine.generated_so_far
        for row, p in list(self.pending.items()):
            n = sum(so_far(rid) for rid in _unfinished_choices(row, p))
            out[p.claimed.batch_id] = out.get(p.claimed.batch_id, 0) + n
        return out

    def _fail_running(self, exc: Exception) -> None:
        """The engine step raised. The requests it ran (StepError says which; all of them if
        it cannot) get a 500 line (batch) or response (online); the others go on."""
        rows = {parse_choice_id(r)[0] for r in exc.request_ids} \
            if isinstance(exc, StepError) else None  # fmt: skip
        err = server_error_result(f"The engine failed while running this request: {exc}")
        failed = 0
        for table in (self.pending, self.online_pending):
            for row in [r for r in table if rows is None or r in rows]:
                self.abort(row)
                self.deliver(row, err)
                failed += 1
        log.error("engine step failed; %d requests failed with it", failed, exc_info=exc)

    def _on_token(self, request_id: str, token_id: int) -> None:
        row, idx = parse_choice_id(request_id)
        if OnlineQueue.owns(row):
            self.post(self.online.token, row, idx, token_id)

    def _table(self, row: int) -> dict[int, PendingRequest]:
        return self.online_pending if OnlineQueue.owns(row) else self.pending

    def _abort_choices(self, row: int, n: int) -> None:
        for i in range(n):
            self.engine.abort(choice_id(row, i))


def _unfinished_choices(row: int, p: PendingRequest) -> Iterator[str]:
    return (choice_id(row, i) for i in range(p.parsed.n) if i not in p.outputs)
