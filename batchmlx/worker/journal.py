"""The worker's account of its work in the log, for whoever runs `batchmlx worker` or `serve`:
one line when it takes up a batch, a progress line per running batch every `every_s`, one line
when a batch ends (its requests, tokens, tok/s and prefix-cache hit rate). The engine's own
figures stay in metrics; this is what a person watching the terminal wants to know."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from batchmlx.core.batch_text import counts_text, hit_rate_text, model_text, tokens_text
from batchmlx.core.progress import RateMeter, batch_meter, estimate_batch, format_eta, format_rate
from batchmlx.core.records import BatchRecord, ClaimedRequest
from batchmlx.store import Store

log = logging.getLogger("batchmlx.worker")

PROGRESS_EVERY_S = 30.0  # default spacing of a running batch's progress lines


@dataclass(slots=True)
class _Followed:
    meter: RateMeter  # the batch's rate over the last window of looks
    next_at: float  # monotonic time of its next progress line


@dataclass(eq=False)
class Journal:
    store: Store
    inflight_tokens: Callable[[], dict[str, int]]  # tokens of requests still in the engine
    every_s: float = PROGRESS_EVERY_S
    _followed: dict[str, _Followed] = field(default_factory=dict, init=False)

    async def claimed(self, claimed: Sequence[ClaimedRequest]) -> None:
        """A line for each batch this worker takes up for the first time."""
        taken: dict[str, int] = {}
        for c in claimed:
            taken[c.batch_id] = taken.get(c.batch_id, 0) + 1
        for batch_id, n in taken.items():
            if batch_id in self._followed:
                continue
            rec = await self.store.get_batch(batch_id)
            if rec is None:
                continue
            meter = batch_meter(rec)
            self._followed[batch_id] = _Followed(meter, time.monotonic() + self.every_s)
            c = rec.request_counts
            log.info("batch %s: claimed %d of its %d requests (%s, model %s); %d done before",
                     batch_id, n, c.total, rec.endpoint, model_text(rec),
                     c.completed + c.failed)  # fmt: skip

    async def progress(self) -> None:
        """A progress line for each followed batch whose turn it is."""
        now = time.monotonic()
        for batch_id, followed in list(self._followed.items()):
            if now < followed.next_at:
                continue
            followed.next_at = now + self.every_s
            rec = await self.store.get_batch(batch_id)
            if rec is None or rec.status.terminal:
                self._followed.pop(batch_id, None)  # another process ended it
                continue
            inflight = self.inflight_tokens().get(batch_id, 0)
            est = estimate_batch(rec, time.time(), followed.meter, inflight)
            log.info("batch %s: %s, %s; %s, ETA %s", batch_id, rec.status.value,
                     counts_text(rec), format_rate(est.tokens_per_s),
                     format_eta(est.eta_s))  # fmt: skip

    def ended(self, rec: BatchRecord) -> None:
        """The line for a batch this worker finalized, cancelled or expired."""
        if not rec.status.terminal:
            return
        self._followed.pop(rec.id, None)
        est = estimate_batch(rec, time.time())
        start, end = rec.work_started_at, rec.work_ended_at
        took = f" in {end - start:.1f}s" if start is not None and end is not None else ""
        log.info("batch %s %s%s: %s; tokens %s; %s; prefix cache hit rate %s", rec.id,
                 rec.status.value, took, counts_text(rec), tokens_text(rec),
                 format_rate(est.tokens_per_s), hit_rate_text(rec))  # fmt: skip
