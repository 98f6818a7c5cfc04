"""Admission: which work enters the engine. Claimed batch requests and the HTTP API's online
tickets both become a ClaimedRequest and enter through `InFlight.start`, the one path; what
differs is where they come from (the store's queue, with leases and attempts; the online queue,
ahead of batch work) and what a request that cannot start gets instead.

`claim` runs on the event loop (the store); `admit_tickets`, `admit_claimed` and `load` touch
the engine, so the worker runs them on the engine's thread."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from batchmlx.config import Settings
from batchmlx.core.priority import Aging, claim_order, engine_priority
from batchmlx.core.records import ClaimedRequest
from batchmlx.faults import crash_point
from batchmlx.store import BatchRef, Store
from batchmlx.worker.build import ServingModel
from batchmlx.worker.inflight import InFlight, ModelUnavailable
from batchmlx.worker.online import ONLINE_PRIORITY, OnlineTicket
from batchmlx.worker.options import WorkerOptions
from batchmlx.worker.translate import server_error_result

log = logging.getLogger("batchmlx.worker")


@dataclass(eq=False)
class Admission:
    store: Store
    settings: Settings
    opts: WorkerOptions
    inflight: InFlight  # where admitted requests go
    worker_id: str  # the lease holder of claimed requests
    clock: Callable[[], float]

    def model_for(self, batch_model: str | None) -> str:
        return self.opts.model or batch_model or self.settings.default_model

    def load(self, model: str | None = None) -> str:
        """Load the serving model now; returns the name response bodies give it."""
        return self.inflight.ensure_model(self.model_for(model)).translator.model_name

    # -- online tickets ------------------------------------------------------------------------
    def admit_tickets(self, tickets: list[OnlineTicket], live: set[int]) -> bool:
        """Admit the server's tickets (priority over batch work); drop abandoned ones (those
        not in `live`). On the engine thread."""
        fl = self.inflight
        if fl.loaded is not None:
            fl.drop_abandoned(live)
        if not tickets:
            return False
        try:
            loaded = fl.ensure_model(fl.loaded.name if fl.loaded else self.model_for(None))
        except Exception as exc:
            if not isinstance(exc, ModelUnavailable):  # (that one is logged by ensure_model)
                log.error("online requests: the model could not be loaded", exc_info=exc)
            err = server_error_result(f"The model could not be loaded: {exc}")
            for t in tickets:
                fl.deliver(t.id, err)
            return True
        for t in tickets:
            t.decode = loaded.translator.tok.decode
            t.model = loaded.translator.model_name
            self._start(loaded, _as_claimed(t, loaded.name))
        return True

    # -- batch work ----------------------------------------------------------------------------
    async def claim(self) -> list[ClaimedRequest]:
        """Lease what tops the engine up, from the oldest in-progress batches this engine can
        serve, all of one model (`admit_claimed` then starts them on the engine thread)."""
        fl = self.inflight
        width = fl.max_batch
        # rows whose media are read hold leases too; a full media pool takes nothing more
        room = self.opts.claim_factor * width - len(fl.pending) - fl.media.batch_rows()
        if room < width or fl.media.full:
            return []
        out: list[ClaimedRequest] = []
        model: str | None = None  # what this round claimed for: one engine holds one model
        now = self.clock()
        aging = Aging(self.opts.engine.priority_aging_s)
        # the most urgent batches first, aged by their wait so none starves (core/priority.py)
        for b in claim_order(await self.store.active_batches(), now, aging):
            if not self._serves(b) or model not in (None, self.model_for(b.model)):
                continue
            claimed = await self.store.claim(
                self.worker_id, room, now, self.settings.lease_s, batch_id=b.id
            )
            # its lines enter the engine at the batch's effective priority, behind online work
            prio = engine_priority(aging.effective(b.priority, now - b.created_at))
            claimed = [replace(c, priority=prio) for c in claimed]
            if claimed:
                crash_point("after_claim")
                model = self.model_for(b.model)
            out += claimed
            room -= len(claimed)
            if room <= 0:
                break
        return out

    def admit_claimed(self, claimed: list[ClaimedRequest]) -> None:
        """Start claimed requests in the engine (on the engine thread)."""
        for c in claimed:
            self._admit_claimed(c)

    def _serves(self, b: BatchRef) -> bool:
        """Whether to claim from `b` now: a model this worker serves, and the loaded one unless
        the engine is idle (one engine holds one model; come back when this one drains)."""
        if self.opts.only_models and (b.model or self.settings.default_model) not in (
            self.opts.only_models
        ):
            return False  # another worker's model
        loaded = self.inflight.loaded
        return loaded is None or self.model_for(b.model) == loaded.name or not self.inflight.busy

    def _admit_claimed(self, c: ClaimedRequest) -> None:
        if c.attempts > self.opts.max_attempts:
            # every earlier run of it ended with its worker gone (killed, crashed): stop trying
            message = (
                f"gave up after {c.attempts - 1} attempts: the worker stopped while running "
                "this request each time"
            )
            self.inflight.deliver(c.id, server_error_result(message))
            return
        try:
            self._start(self.inflight.ensure_model(self.model_for(c.model)), c)
        except ModelUnavailable as exc:  # logged once by ensure_model
            self.inflight.deliver(c.id, server_error_result(f"The request could not start: {exc}"))
        except Exception as exc:  # tied to this request (or its batch's model)
            log.error("request %s of %s could not start", c.custom_id, c.batch_id, exc_info=exc)
            self.inflight.deliver(c.id, server_error_result(f"The request could not start: {exc}"))

    def _start(self, loaded: ServingModel, c: ClaimedRequest) -> None:
        error = self.inflight.start(loaded, c)
        if error is not None:
            self.inflight.deliver(c.id, error)


def _as_claimed(t: OnlineTicket, model: str) -> ClaimedRequest:
    """An online ticket as the request a claim would give (no batch, no line, one attempt)."""
    return ClaimedRequest(
        id=t.id, batch_id="", custom_id="", line=0, endpoint=t.endpoint,
        model=model, body=t.body, attempts=1, priority=ONLINE_PRIORITY,
    )  # fmt: skip
