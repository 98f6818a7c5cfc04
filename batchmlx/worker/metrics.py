"""Prometheus metrics and the throughput series of this process: one registry per process.

The worker updates them once per engine step from counters the engine and scheduler already
keep (`Engine.counters()`), and once per result flush; queue depths are read from the store when
someone looks (a scrape of the server's /metrics, or every few seconds for `worker
--metrics-port`). Nothing here runs per token.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import deque
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from batchmlx.core.lifecycle import RequestStatus
from batchmlx.core.records import RequestResult
from batchmlx.core.request import CacheOutcome
from batchmlx.core.telemetry import EngineCounters

REGISTRY = CollectorRegistry()

BATCHES = Gauge("batchmlx_batches", "Batches by status", ["status"], registry=REGISTRY)
QUEUE = Gauge("batchmlx_queue_requests", "Requests by status: the queue's depth", ["status"],
              registry=REGISTRY)  # fmt: skip
REQUESTS_COMPLETED = Counter(
    "batchmlx_requests_completed", "Requests finished with a response body (batch results "
    "when written, online ones when answered)", ["source"], registry=REGISTRY,
)  # fmt: skip
REQUESTS_FAILED = Counter("batchmlx_requests_failed", "Requests finished with an error",
                          ["source"], registry=REGISTRY)  # fmt: skip
PROMPT_TOKENS = Counter("batchmlx_prompt_tokens", "Prompt tokens of finished requests",
                        registry=REGISTRY)  # fmt: skip
CACHED_TOKENS = Counter(
    "batchmlx_cached_tokens",
    "Prompt tokens of finished requests served from the prefix cache",
    registry=REGISTRY,
)
GENERATED_TOKENS = Counter(
    "batchmlx_generated_tokens",
    "Tokens sampled by the engine (end-of-sequence tokens too)",
    registry=REGISTRY,
)
STEP_SECONDS = Histogram(
    "batchmlx_step_seconds", "Wall time of one engine step", registry=REGISTRY,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)  # fmt: skip
RUNNING = Gauge("batchmlx_running_batch_size", "Sequences in the engine's running batch",
                registry=REGISTRY)  # fmt: skip
KV_BLOCKS = Gauge(
    "batchmlx_kv_blocks", "KV blocks: in_use (held by a sequence), cached (holding a prefix, in "
    "use or evictable), free (allocatable, evictable cached ones included)", ["state"],
    registry=REGISTRY,
)  # fmt: skip
PREEMPTIONS = Counter("batchmlx_preemptions", "Sequences preempted (recomputed later)",
                      registry=REGISTRY)  # fmt: skip
PREFIX_OUTCOMES = Counter(
    "batchmlx_prefix_cache_outcomes",
    "First admissions by prefix-cache outcome",
    ["outcome"],
    registry=REGISTRY,
)
MLX_MEMORY = Gauge(
    "batchmlx_mlx_memory_bytes", "MLX's memory after the last engine step: active (arrays in "
    "use), cache (freed buffers kept for reuse, bounded by its limit), peak (active's highest)",
    ["kind"], registry=REGISTRY,
)  # fmt: skip
for _s in ("batch", "online"):
    REQUESTS_COMPLETED.labels(_s)
    REQUESTS_FAILED.labels(_s)
for _o in CacheOutcome:
    PREFIX_OUTCOMES.labels(_o.name)
for _k in ("in_use", "cached", "free"):
    KV_BLOCKS.labels(_k)

SERIES_SECONDS = 600  # the dashboard's chart: one point per second, the last ten minutes
QUEUE_REFRESH_S = 2.0  # queue depths for `worker --metrics-port`, which has no scrape hook


@dataclass(slots=True)
class Point:
    t: int  # unix second
    tokens: float  # generated in that second (a step's tokens spread over its duration)
    running: int  # the largest running batch in that second
    end_running: int  # the running batch the second's last step left (idle seconds keep it)


class Series:
    """A ring buffer of per-second points, fed at each engine step."""

    def __init__(self, seconds: int = SERIES_SECONDS) -> None:
        self.points: deque[Point] = deque(maxlen=seconds)
        self.latest = EngineCounters()  # the newest step's counters (the page's gauges)

    def add(self, now: float, tokens: int, running: int, duration: float = 0.0) -> None:
        """A step that ended at `now` after `duration` seconds: its tokens are spread over the
        seconds it took, so a step longer than a second does not draw as one spike."""
        start = now - duration if duration > 0 else now
        sec = int(start)
        while sec <= int(now):
            if now > start:
                share = tokens * (min(now, sec + 1) - max(start, sec)) / (now - start)
            else:
                share = float(tokens)
            self._bump(sec, share)
            sec += 1
        last = self.points[-1]
        last.running, last.end_running = max(last.running, running), running

    def _bump(self, sec: int, tokens: float) -> None:
        for p in reversed(self.points):  # a step's first seconds may already have a point
            if p.t == sec:
                p.tokens += tokens
                return
            if p.t < sec:
                break
        if not self.points or sec > self.points[-1].t:
            running = self.points[-1].end_running if self.points else 0
            self.points.append(Point(sec, tokens, running, running))
        # else: older than the buffer's order allows (a clock step back): dropped

    def window(self, now: float, seconds: int = SERIES_SECONDS) -> list[dict[str, float]]:
        """Complete seconds up to `now`, oldest first. A second without a step generated
        nothing, and the running batch stays what the last step left."""
        end = int(now)  # the current second is still filling: leave it out
        running = 0
        by_t: dict[int, Point] = {}
        # a copy: the engine thread adds points while the loop reads (list() is one C call)
        for p in list(self.points):
            if p.t < end - seconds:
                running = p.end_running  # the batch size the window starts with
            elif p.t < end:
                by_t[p.t] = p
        out = []
        for t in range(end - seconds, end):
            p = by_t.get(t)
            if p is None:
                out.append({"t": t, "tokens": 0, "running": running})
            else:
                out.append({"t": t, "tokens": round(p.tokens, 1), "running": p.running})
                running = p.end_running
        return out


SERIES = Series()


_WORKERS: weakref.WeakSet[Any] = weakref.WeakSet()  # this process's workers


def register_worker(worker: Any) -> None:
    _WORKERS.add(worker)


def inflight_tokens() -> dict[str, int]:
    """Tokens generated so far by requests still running in this process's workers, per batch
    (finished requests count in the batch's usage instead)."""
    out: dict[str, int] = {}
    for w in list(_WORKERS):
        for batch_id, n in w.inflight_tokens().items():
            out[batch_id] = out.get(batch_id, 0) + n
    return out


def mlx_memory() -> dict[str, int]:
    """MLX's memory figures (three C calls; {} where MLX is not imported: test doubles)."""
    import sys

    mx = sys.modules.get("mlx.core")
    if mx is None:
        return {}
    return {"active": mx.get_active_memory(), "cache": mx.get_cache_memory(),
            "peak": mx.get_peak_memory()}  # fmt: skip


class EngineMetrics:
    """One worker's hook: turns an engine's cumulative counters into increments."""

    def __init__(self, series: Series = SERIES) -> None:
        self.series = series
        self._engine: Any = None
        self._last = EngineCounters()

    def after_step(self, engine: Any, now: float) -> None:
        counters = getattr(engine, "counters", None)
        if counters is None:
            return  # an engine without telemetry (test doubles)
        c: EngineCounters = counters()
        if engine is not self._engine:  # a new engine (model switch) counts from zero
            self._engine, self._last = engine, EngineCounters()
        last, self._last = self._last, c
        if c.steps > last.steps:
            per_step = (c.step_s - last.step_s) / (c.steps - last.steps)
            for _ in range(c.steps - last.steps):
                STEP_SECONDS.observe(per_step)
        GENERATED_TOKENS.inc(c.generated_tokens - last.generated_tokens)
        PREEMPTIONS.inc(c.preemptions - last.preemptions)
        PREFIX_OUTCOMES.labels(CacheOutcome.HIT.name).inc(c.hits - last.hits)
        PREFIX_OUTCOMES.labels(CacheOutcome.PREFIX_HIT.name).inc(c.prefix_hits - last.prefix_hits)
        PREFIX_OUTCOMES.labels(CacheOutcome.MISS.name).inc(c.misses - last.misses)
        RUNNING.set(c.running)
        KV_BLOCKS.labels("in_use").set(c.blocks_in_use)
        KV_BLOCKS.labels("cached").set(c.blocks_cached)
        KV_BLOCKS.labels("free").set(c.blocks_free)
        for kind, value in mlx_memory().items():
            MLX_MEMORY.labels(kind).set(value)
        self.series.add(now, c.generated_tokens - last.generated_tokens, c.running,
                        c.step_s - last.step_s)  # fmt: skip
        self.series.latest = c

    @staticmethod
    def results(results: Iterable[RequestResult], source: str = "batch") -> None:
        ok = failed = prompt = cached = 0
        for r in results:
            if r.status is RequestStatus.SUCCEEDED:
                ok += 1
            else:
                failed += 1
            prompt += r.prompt_tokens
            cached += r.cached_tokens
        REQUESTS_COMPLETED.labels(source).inc(ok)
        REQUESTS_FAILED.labels(source).inc(failed)
        PROMPT_TOKENS.inc(prompt)
        CACHED_TOKENS.inc(cached)


async def refresh_queue(store: Any) -> None:
    """Queue depths from the store (one grouped query per table)."""
    batches, requests = await store.status_counts()
    for status, n in batches.items():
        BATCHES.labels(status.value).set(n)
    for status, n in requests.items():
        QUEUE.labels(status.value).set(n)


async def with_queue_metrics(settings: Any, work: Awaitable[None]) -> None:
    """Run `work` while keeping the queue-depth gauges fresh from the store."""
    from batchmlx.store import Store

    async def refresh_forever(store: Any) -> None:
        while True:
            with contextlib.suppress(Exception):  # a busy database: try again next time
                await refresh_queue(store)
            await asyncio.sleep(QUEUE_REFRESH_S)

    store = await Store.from_settings(settings)
    task = asyncio.create_task(refresh_forever(store))
    try:
        await work
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await store.close()


def serve_metrics(port: int, host: str) -> None:
    """/metrics on its own port, in a thread (prometheus_client's server)."""
    from prometheus_client import start_http_server

    start_http_server(port, addr=host, registry=REGISTRY)
