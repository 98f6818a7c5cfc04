"""What every handler shares: the store, the settings, the options, the in-process worker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchmlx.batches.finalize import FinalizeHook
from batchmlx.batches.intake import validate_batch
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.model_rule import ModelRule
from batchmlx.store import Store
from batchmlx.store.errors import is_transient_db_error
from batchmlx.worker.resilience import Backoff

if TYPE_CHECKING:
    from batchmlx.worker import Worker, WorkerOptions

log = logging.getLogger("batchmlx.server")

DEFAULT_MAX_UPLOAD_BYTES = 200 * 1024 * 1024  # OpenAI's batch input limit
DEFAULT_MAX_JSON_BYTES = 16 * 1024 * 1024  # a JSON request body (batches, online requests)


@dataclass(frozen=True)
class ServerOptions:
    # answers every batch and online request whose model is no alias of it (or refuses them:
    # settings.strict_models); docs/models.md
    model: str = "default"
    api_key: str | None = None
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES
    allowed_hosts: tuple[str, ...] = ()  # Host names besides the bound one and loopback's
    stream_interval: int = 1  # send streamed tokens in groups of this many (1: every token)
    worker: WorkerOptions | None = None  # None: no worker in this process (--no-worker)
    validate_poll_s: float = 1.0  # how often batches created elsewhere are looked for


async def keep_running(name: str, step: Callable[[], Awaitable[float]], backoff: Backoff) -> None:
    """Run `step` again and again (it returns how long to wait before the next run) for as
    long as the server runs. A fault does not end the task: it is logged in one line (a
    database that is away: no traceback) and the step runs again after a growing delay."""
    while True:
        try:
            pause = await step()
        except Exception as exc:
            delay = backoff.next()
            if is_transient_db_error(exc):
                log.warning("%s: the database is unavailable (%s); retrying in %.1fs",
                            name, getattr(exc, "orig", None) or exc, delay)  # fmt: skip
            else:
                log.exception("%s failed; retrying in %.1fs", name, delay)
            await asyncio.sleep(delay)
            continue
        backoff.reset()
        await asyncio.sleep(pause)


class Validator:
    """Validates `validating` batches after their create call has answered, as OpenAI does.

    Woken at once by a create in this server; polls for batches other servers created. Runs
    under `keep_running`: a database restart delays validation, never ends it."""

    def __init__(self, store: Store, settings: Settings, rule: ModelRule, poll_s: float) -> None:
        self.store, self.settings, self.rule, self.poll_s = store, settings, rule, poll_s
        self.wake = asyncio.Event()

    async def validate(self, batch_id: str) -> None:
        try:
            await validate_batch(
                self.store, self.settings, batch_id, now=time.time(), rule=self.rule
            )
        except Exception as exc:
            if is_transient_db_error(exc):
                raise  # the batch stays validating; the whole pass is retried after a backoff
            log.exception("validating %s failed", batch_id)

    async def pass_once(self) -> float:
        """Validate every `validating` batch, then wait for a wake-up or the next poll."""
        self.wake.clear()
        for ref in await self.store.batches_with_status(BatchStatus.VALIDATING):
            await self.validate(ref.id)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), self.poll_s)
        return 0.0

    async def run(self) -> None:
        await keep_running("the validator", self.pass_once, Backoff(first=0.5, cap=10.0))


@dataclass
class ServerContext:
    store: Store
    settings: Settings
    options: ServerOptions
    validator: Validator
    model_name: str  # the name response bodies and /v1/models give the served model
    finalize_hooks: tuple[FinalizeHook, ...] = ()  # run by each finalize this server does
    worker: Worker | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    worker_task: asyncio.Task[Any] | None = None

    @property
    def worker_alive(self) -> bool:
        return (
            self.worker is not None and self.worker_task is not None and not self.worker_task.done()
        )
