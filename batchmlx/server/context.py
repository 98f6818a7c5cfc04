"""What every handler shares: the store, the settings, the options, the in-process worker."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from batchmlx.batches.finalize import FinalizeHook
from batchmlx.batches.intake import validate_batch
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.store import Store

if TYPE_CHECKING:
    from batchmlx.worker import Worker, WorkerOptions

log = logging.getLogger("batchmlx.server")

DEFAULT_MAX_UPLOAD_BYTES = 200 * 1024 * 1024  # OpenAI's batch input limit
DEFAULT_MAX_JSON_BYTES = 16 * 1024 * 1024  # a JSON request body (batches, online requests)


@dataclass(frozen=True)
class ServerOptions:
    model: str = "default"  # serves every batch and online request, whatever bodies name
    api_key: str | None = None
    max_upload_bytes: int = DEFAULT_MAX_UPLOAD_BYTES
    max_json_bytes: int = DEFAULT_MAX_JSON_BYTES
    allowed_hosts: tuple[str, ...] = ()  # Host names besides the bound one and loopback's
    stream_interval: int = 1  # send streamed tokens in groups of this many (1: every token)
    worker: WorkerOptions | None = None  # None: no worker in this process (--no-worker)
    validate_poll_s: float = 1.0  # how often batches created elsewhere are looked for


class Validator:
    """Validates `validating` batches after their create call has answered, as OpenAI does.

    Woken at once by a create in this server; polls for batches other servers created."""

    def __init__(self, store: Store, settings: Settings, model: str, poll_s: float) -> None:
        self.store, self.settings, self.model, self.poll_s = store, settings, model, poll_s
        self.wake = asyncio.Event()

    async def validate(self, batch_id: str) -> None:
        try:
            await validate_batch(
                self.store, self.settings, batch_id, now=time.time(), model=self.model
            )
        except Exception:
            log.exception("validating %s failed", batch_id)

    async def run(self) -> None:
        while True:
            self.wake.clear()
            for ref in await self.store.batches_with_status(BatchStatus.VALIDATING):
                await self.validate(ref.id)
            try:
                await asyncio.wait_for(self.wake.wait(), self.poll_s)
            except TimeoutError:
                pass


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
        return self.worker is not None and self.worker_task is not None \
            and not self.worker_task.done()
