"""`submit --wait`'s progress: a rich bar with tokens/s and an ETA on a terminal, plain lines
when stdout or stderr is not one (logs, CI, pipes). Both go to stderr; stdout keeps the result."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.progress import (
    RateMeter,
    batch_meter,
    estimate_batch,
    format_eta,
    format_rate,
)
from batchmlx.core.records import BatchRecord
from batchmlx.worker.metrics import inflight_tokens

REFRESH_S = 0.5  # how often the batch is read
PLAIN_EVERY_S = 5.0  # plain lines: one per status change, else at most one per this many seconds


def eta_text(rec: BatchRecord, eta_s: float | None) -> str:
    return format_eta(eta_s) if rec.status is BatchStatus.IN_PROGRESS else "n/a"


class ProgressView:
    def __init__(
        self, store: Any, batch_id: str, quiet: bool, *, console: Console | None = None,
        live: bool | None = None,
    ) -> None:  # fmt: skip
        self.store, self.batch_id, self.quiet = store, batch_id, quiet
        self.console = console or Console(stderr=True)
        self.live = (sys.stdout.isatty() and self.console.is_terminal) if live is None else live
        self.t0 = time.time()
        self.meter: RateMeter | None = None
        self._bar: Progress | None = None
        self._task: Any = None
        self._last_plain: tuple[BatchStatus | None, float] = (None, 0.0)

    async def run(self) -> None:
        while True:
            await self.show()
            await asyncio.sleep(REFRESH_S)

    async def show(self, final: bool = False) -> None:
        if self.quiet:
            return
        rec = await self.store.get_batch(self.batch_id)
        now = time.time()
        if self.meter is None and rec.work_started_at is not None:
            self.meter = batch_meter(rec)
        # requests still running in this process (`--wait` without a live worker) count too
        est = estimate_batch(rec, now, self.meter, inflight_tokens().get(self.batch_id, 0))
        c = rec.request_counts
        done = c.completed + c.failed
        rate, eta = format_rate(est.tokens_per_s), eta_text(rec, est.eta_s)
        if self.live:
            self._show_live(rec, done, rate, eta, final)
        else:
            self._show_plain(rec, done, rate, eta, now, final)

    def _show_live(self, rec: BatchRecord, done: int, rate: str, eta: str, final: bool) -> None:
        fields = dict(completed=done, total=rec.request_counts.total or None,
                      status=rec.status.value, rate=rate, eta=eta)  # fmt: skip
        if self._bar is None:
            # redrawn at each look (every REFRESH_S), not by rich's own timer thread
            self._bar = Progress(
                TextColumn("{task.fields[status]:<11}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]:>14}"), TextColumn("ETA {task.fields[eta]}"),
                TimeElapsedColumn(), console=self.console, auto_refresh=False,
            )  # fmt: skip
            self._task = self._bar.add_task(self.batch_id, **fields)
            self._bar.start()
        else:
            self._bar.update(self._task, **fields)
        self._bar.refresh()
        if final:
            self._bar.stop()
            self._bar = None

    def _show_plain(
        self, rec: BatchRecord, done: int, rate: str, eta: str, now: float, final: bool
    ) -> None:
        status, at = self._last_plain
        if not final and rec.status is status and now - at < PLAIN_EVERY_S:
            return
        self._last_plain = (rec.status, now)
        total = rec.request_counts.total
        pct = f"{100 * done / total:.0f}%" if total else "-"
        self.console.print(
            f"{self.batch_id} {rec.status.value} {done}/{total} ({pct})  {rate}  ETA {eta}  "
            f"{now - self.t0:.0f}s", highlight=False, soft_wrap=True,
        )  # fmt: skip
