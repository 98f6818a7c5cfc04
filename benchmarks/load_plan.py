"""What `python -m benchmarks.load_serve` drives and records: the plan of the load (full and
`--quick`), the pollers, the targets' bounds, the record a run fills and its outcome."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

HOST = "127.0.0.1"  # loopback only, always
P99_TARGET_S = 0.250
MAX_TARGET_S = 1.0
SLOW_S = 0.25  # a control request slower than this is listed in the report, with when it was sent
RSS_FLAT_PCT = 10.0  # memory flat: last third's median RSS within this % above the middle's
CONTROL_TIMEOUT_S = 30.0  # default: a control request slower than this is an error (a timeout)
MAX_INFLIGHT = 64  # per poller: beyond it a slot is skipped (and counted), the load stays bounded
CANCEL_TIMEOUT_S = 180.0  # a batch cancelled at its timeout, to settle
TERMINAL = ("completed", "failed", "expired", "cancelled")
MAX_RSS_GB = 12.0  # the machine is shared: a server above this is killed (and the run fails)


@dataclass(frozen=True)
class Plan:
    batch: int = 2000  # requests in the batch
    batch_max_tokens: int = 4  # short answers: the batch ends in bounded time
    streams: int = 32  # concurrent online streamed chats
    rounds: int = 6  # each stream's requests, one after another
    stream_max_tokens: int = 16
    stream_gap_s: float = 3.0  # pause between a stream's rounds
    stream_timeout_s: float = 300.0
    embed_inputs: int = 2048  # one online embeddings request of this many inputs
    embed_after_s: float = 5.0  # sent this long after the load starts
    embed_timeout_s: float = 600.0
    batch_timeout_s: float = 1500.0  # from create to a terminal status; then it is cancelled
    start_timeout_s: float = 300.0  # server start, model loaded
    hard_timeout_s: float = 2100.0  # the whole run; then the server is killed
    rss_every_s: float = 1.0
    control_timeout_s: float = CONTROL_TIMEOUT_S  # a polled request slower: a timeout error


QUICK = Plan(batch=200, streams=8, rounds=2, stream_gap_s=1.0, embed_inputs=256,
             embed_after_s=2.0, batch_timeout_s=240.0, hard_timeout_s=420.0)  # fmt: skip


@dataclass(frozen=True)
class Poller:
    name: str
    path: str  # {batch} is the batch's id
    hz: float


POLLERS = (
    Poller("GET /v1/batches/ID", "/v1/batches/{batch}", 2.0),
    Poller("GET /v1/models", "/v1/models", 2.0),
    Poller("GET /dashboard/api/summary", "/dashboard/api/summary", 1.0),  # as the page polls
    Poller("GET /metrics", "/metrics", 1.0),
)


@dataclass
class Failure:
    what: str  # the request (route) or part
    kind: str  # "status 503", "timeout", an exception's class
    detail: str
    at_s: float  # since the load started


@dataclass
class Record:
    t0: float = field(default_factory=time.perf_counter)
    latency: dict[str, list[float]] = field(default_factory=dict)
    slow: list[tuple[float, str, float]] = field(default_factory=list)  # (sent at, what, s)
    skipped: Counter = field(default_factory=Counter)
    failures: list[Failure] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    stream_requests: int = 0
    stream_tokens: int = 0
    embed_s: float | None = None
    rss: list[tuple[float, int]] = field(default_factory=list)  # (s since t0, bytes)
    # MLX's memory as /metrics reports it: (s since t0, {"active": bytes, "cache": bytes, ...})
    mlx: list[tuple[float, dict[str, float]]] = field(default_factory=list)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def fail(self, what: str, kind: str, detail: str = "") -> None:
        self.failures.append(Failure(what, kind, detail[:300], self.now()))


def _pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); nan for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q / 100 * len(s) + 0.5)) - 1))]


@dataclass
class Outcome:
    plan: Plan
    rec: Record
    batch: dict[str, Any]
    batch_wall_s: float
    load_s: float
    ids: Counter
    output_rows: int
    error_rows: int
    ready_s: float
    stop_code: int | None = None
    stop_s: float = 0.0
    tracebacks: list[str] = field(default_factory=list)
    graceful: bool = False  # the log says uvicorn's shutdown completed
