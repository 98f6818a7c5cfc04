"""`serve` never runs without a live worker: the worker runs under a supervisor that, when it
stops by itself, fails the online requests it held (an error response, never a hang), starts a
new one, and after too many restarts shuts the server down to exit non-zero."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from batchmlx.worker.resilience import Backoff

if TYPE_CHECKING:
    from batchmlx.worker import Worker

log = logging.getLogger("batchmlx.server")

MAX_RESTARTS = 5  # in a row without an hour of steady running; then `serve` exits 1
STEADY_S = 3600.0  # a worker that ran this long resets the count

WORKER_STOPPED = {
    "error": {
        "message": "The worker stopped while running this request and is being restarted. "
        "Please retry your request.",
        "type": "server_error",
        "param": None,
        "code": "worker_stopped",
    }
}


class Supervisor:
    """Runs `worker`, replacing it (same online queue) each time it stops unasked."""

    def __init__(
        self,
        worker: Worker,
        make_worker: Callable[[], Worker | Awaitable[Worker]],  # `serve`'s loads off the loop
        *,
        on_give_up: Callable[[], None] = lambda: None,  # `serve`: shut the server down
        first_delay: float = 0.5,
    ) -> None:
        self.worker = worker
        self.make_worker = make_worker
        self.on_give_up = on_give_up
        self.stopping = False
        self.failed = False  # gave up: the server shuts down and exits non-zero
        self._backoff = Backoff(first=first_delay)

    def stop(self) -> None:
        """Graceful shutdown: the worker finishes its step and gives back its leases."""
        self.stopping = True
        self.worker.stop_requested = True

    async def run(self) -> None:
        restarts = 0
        while True:
            started = time.monotonic()
            try:
                await self.worker.run()
                reason: BaseException | None = None
            except Exception as exc:
                reason = exc
            if self.stopping:
                return
            failed = self.worker.online.fail_all(503, WORKER_STOPPED)
            log.error("the worker stopped (%d online requests answered 503)", failed,
                      exc_info=reason)  # fmt: skip
            if time.monotonic() - started >= STEADY_S:
                restarts = 0
                self._backoff.reset()
            while True:
                restarts += 1
                if restarts > MAX_RESTARTS:
                    self._give_up()
                    return
                await asyncio.sleep(self._backoff.next())
                if self.stopping:
                    return
                try:
                    self.worker = await self._replacement()
                    break
                except Exception as exc:
                    log.error("restarting the worker failed", exc_info=exc)
            log.info("worker restarted (%d of at most %d in a row)", restarts, MAX_RESTARTS)

    async def _replacement(self) -> Worker:
        old = self.worker
        made = self.make_worker()
        new = await made if inspect.isawaitable(made) else made
        new.online = old.online  # tickets sent meanwhile wait for the new worker
        return new

    def _give_up(self) -> None:
        log.error("the worker stopped %d times in a row; shutting the server down", MAX_RESTARTS)
        self.failed = True
        self.worker.online.fail_all(503, WORKER_STOPPED)
        self.on_give_up()
