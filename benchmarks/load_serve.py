"""Load test of `batchmlx serve` (issue 21, item 7): does the server stay quick and correct while
a large batch, many online streams and a large embeddings request share it?

    python -m benchmarks.load_serve [--quick] [--database-url URL] [--out PATH]

A real `batchmlx serve` subprocess on 127.0.0.1 (a fresh $BATCHMLX_HOME, SQLite unless
`--database-url` names another queue; the default model from $BATCHMLX_CACHE_DIR, else
$BATCHMLX_TEST_CACHE, else ~/.cache/batchmlx-test, where the tests keep it). While a batch runs
(uploaded through the Files API, created through the Batches API, short answers), it drives
concurrent streamed chats (`stream: true`), one embeddings request of many inputs, and pollers of
the control endpoints, each at a fixed rate and open-loop (a slot's request is sent on time even
when earlier ones are still waiting, so a stall is measured by every request it delays, not just
one). It samples the server's RSS from /proc and, at the end, checks that the batch's output
and error files hold every custom_id exactly once.

Everything is bounded: each loop in count and time, each request by a timeout, the whole run by a
hard limit that kills the server. The report (stdout, and `--out`: default
benchmarks/RESULTS-load.md for a full run, none for --quick) has a table of the targets with
met / not met. Exit 1: a target not met; with `--quick` only the correctness targets count
(errors, rows lost or duplicated, a traceback in the server log): its latency and memory figures
are reported only, since CI machines vary. Exit 2: the run did not finish (server start, hard
timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import orjson

try:  # the openai SDK's HTTP client (a test dependency): httpx, published as httpx2 of late
    import httpx2 as httpx
except ImportError:  # pragma: no cover - an older environment
    import httpx  # type: ignore[no-redef]

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


# ---------------------------------------------------------------- the server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen
    base: str
    log: Path

    def rss(self) -> int | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def stop(self, wait_s: float = 30.0) -> tuple[int | None, float]:
        """SIGTERM, then SIGKILL after `wait_s`: (exit code, seconds to exit)."""
        t = time.perf_counter()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode, time.perf_counter() - t

    def tracebacks(self) -> list[str]:
        lines = self.log.read_text(errors="replace").splitlines()
        return [lines[i + 1] if i + 1 < len(lines) else ln for i, ln in enumerate(lines)
                if ln.startswith("Traceback")]  # fmt: skip


def start_server(home: Path, database_url: str | None) -> Server:
    port = _free_port()
    env = dict(os.environ, BATCHMLX_HOME=str(home))
    # the converted model the tests share (tests/e2e/helpers.py): CI converts it once
    cache = os.environ.get("BATCHMLX_TEST_CACHE") or Path.home() / ".cache" / "batchmlx-test"
    env.setdefault("BATCHMLX_CACHE_DIR", str(Path(cache).expanduser()))
    env.pop("BATCHMLX_API_KEY", None)  # the harness sends no key
    db = ["--database-url", database_url] if database_url else []
    log = home / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchmlx.cli", *db, "serve", "--host", HOST,
             "--port", str(port)],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return Server(proc, f"http://{HOST}:{port}", log)


async def wait_ready(server: Server, timeout_s: float) -> float:
    t = time.perf_counter()
    async with httpx.AsyncClient(base_url=server.base, timeout=5) as c:
        while time.perf_counter() - t < timeout_s:
            if server.proc.poll() is not None:
                raise RuntimeError(f"server exited with {server.proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if (await c.get("/v1/models")).status_code == 200:
                    return time.perf_counter() - t
            await asyncio.sleep(0.3)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s")


# ---------------------------------------------------------------- the load


def batch_lines(n: int, max_tokens: int,
                question: str = "Name one colour. This is request {i}.") -> bytes:  # fmt: skip
    lines = (
        {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "default", "max_tokens": max_tokens, "temperature": 0,
                  "messages": [{"role": "user", "content": question.format(i=i)}]}}
        for i in range(n)
    )  # fmt: skip
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


async def create_batch(c: httpx.AsyncClient, plan: Plan, question: str | None = None) -> str:
    data = batch_lines(plan.batch, plan.batch_max_tokens, *([question] if question else []))
    up = await c.post("/v1/files", data={"purpose": "batch"},
                      files={"file": ("load.jsonl", data, "application/jsonl")})  # fmt: skip
    up.raise_for_status()
    b = await c.post("/v1/batches", json={"input_file_id": up.json()["id"],
                                          "endpoint": "/v1/chat/completions",
                                          "completion_window": "24h"})  # fmt: skip
    b.raise_for_status()
    return b.json()["id"]


async def _control_once(c: httpx.AsyncClient, p: Poller, path: str, rec: Record,
                        timeout_s: float) -> None:  # fmt: skip
    t = time.perf_counter()
    try:
        r = await c.get(path, timeout=timeout_s)
        dt = time.perf_counter() - t
    except httpx.TimeoutException:
        rec.fail(p.name, "timeout", f"no answer in {timeout_s:g} s")
        return
    except Exception as exc:  # noqa: BLE001 - every exception is a recorded error
        rec.fail(p.name, type(exc).__name__, str(exc))
        return
    if not 200 <= r.status_code < 300:
        rec.fail(p.name, f"status {r.status_code}", r.text)
        return
    rec.latency.setdefault(p.name, []).append(dt)
    if dt > SLOW_S:
        rec.slow.append((t - rec.t0, p.name, dt))
    if p.path == "/metrics":
        mlx = _mlx_gauges(r.text)
        if mlx:
            rec.mlx.append((rec.now(), mlx))


def _mlx_gauges(text: str) -> dict[str, float]:
    """batchmlx_mlx_memory_bytes{kind="..."} lines of a /metrics body."""
    out = {}
    for line in text.splitlines():
        if line.startswith('batchmlx_mlx_memory_bytes{kind="'):
            kind, _, value = line[len('batchmlx_mlx_memory_bytes{kind="') :].partition('"} ')
            out[kind] = float(value)
    return out


async def poll(c: httpx.AsyncClient, p: Poller, batch_id: str, rec: Record,
               stop: asyncio.Event, plan: Plan) -> None:  # fmt: skip
    """GET `p.path` at `p.hz`, open-loop, until `stop` or the batch's timeout."""
    max_s = plan.batch_timeout_s
    path = p.path.format(batch=batch_id)
    period = 1.0 / p.hz
    pending: set[asyncio.Task] = set()
    t0 = time.perf_counter()
    for k in range(int(max_s * p.hz) + 1):
        delay = t0 + k * period - time.perf_counter()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
        if stop.is_set():
            break
        if len(pending) >= MAX_INFLIGHT:
            rec.skipped[p.name] += 1
            continue
        task = asyncio.create_task(_control_once(c, p, path, rec, plan.control_timeout_s))
        pending.add(task)
        task.add_done_callback(pending.discard)
    await asyncio.gather(*pending)


async def one_stream(c: httpx.AsyncClient, plan: Plan, i: int, rnd: int, rec: Record) -> None:
    what = "POST /v1/chat/completions (stream)"
    body = {
        "model": "default",
        "stream": True,
        "max_tokens": plan.stream_max_tokens,
        "temperature": 0,
        "messages": [{"role": "user", "content": f"Stream {i}, round {rnd}: tell me a fact."}],
    }
    t = time.perf_counter()
    last: float | None = None
    done = False
    try:
        async with c.stream("POST", "/v1/chat/completions", json=body,
                            timeout=plan.stream_timeout_s) as r:  # fmt: skip
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                rec.fail(what, f"status {r.status_code}", text)
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.fail(what, "error event", line)
                    return
                if not any((ch.get("delta") or {}).get("content") for ch in chunk["choices"]):
                    continue
                now = time.perf_counter()
                rec.stream_tokens += 1
                if last is None:
                    rec.ttft.append(now - t)
                else:
                    rec.itl.append(now - last)
                last = now
    except httpx.TimeoutException:
        rec.fail(what, "timeout", f"stream not done in {plan.stream_timeout_s:.0f} s")
        return
    except Exception as exc:  # noqa: BLE001 - every exception is a recorded error
        rec.fail(what, type(exc).__name__, str(exc))
        return
    rec.stream_requests += 1
    if not done:
        rec.fail(what, "truncated", "the stream ended without data: [DONE]")


async def stream_client(c: httpx.AsyncClient, plan: Plan, i: int, rec: Record,
                        stop: asyncio.Event) -> None:  # fmt: skip
    await asyncio.sleep(i * 0.05)  # staggered starts, as real clients arrive
    for rnd in range(plan.rounds):
        if stop.is_set():
            return
        await one_stream(c, plan, i, rnd, rec)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), plan.stream_gap_s)


async def embeddings(c: httpx.AsyncClient, plan: Plan, rec: Record) -> None:
    what = f"POST /v1/embeddings ({plan.embed_inputs} inputs)"
    await asyncio.sleep(plan.embed_after_s)
    inputs = [f"Sentence number {i} about the weather today." for i in range(plan.embed_inputs)]
    t = time.perf_counter()
    try:
        r = await c.post("/v1/embeddings", json={"model": "default", "input": inputs},
                         timeout=plan.embed_timeout_s)  # fmt: skip
    except httpx.TimeoutException:
        rec.fail(what, "timeout", f"no answer in {plan.embed_timeout_s:.0f} s")
        return
    except Exception as exc:  # noqa: BLE001 - every exception is a recorded error
        rec.fail(what, type(exc).__name__, str(exc))
        return
    rec.embed_s = time.perf_counter() - t
    if r.status_code != 200:
        rec.fail(what, f"status {r.status_code}", r.text)
        return
    # ~23 MB of JSON, parsed while this loop times every other request: a parser in a thread
    # holds the GIL all the same (stdlib json: ~0.33 s, seen as a stall of every endpoint at
    # once), orjson ~0.1 s
    body = orjson.loads(r.content)
    got = sorted(d["index"] for d in body["data"])
    if got != list(range(plan.embed_inputs)):
        rec.fail(what, "wrong data", f"{len(got)} embeddings, indexes not 0..n-1")


async def sample_rss(server: Server, rec: Record, stop: asyncio.Event, plan: Plan,
                     max_rss_gb: float) -> None:  # fmt: skip
    for _ in range(int(plan.hard_timeout_s / plan.rss_every_s) + 1):
        rss = server.rss()
        if rss is not None:
            rec.rss.append((rec.now(), rss))
            if rss > max_rss_gb * 2**30:
                rec.fail("serve", "killed", f"RSS {rss / 2**30:.1f} GB over --max-rss-gb")
                server.proc.kill()
                return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), plan.rss_every_s)
        if stop.is_set():
            return


async def wait_batch(c: httpx.AsyncClient, batch_id: str, timeout_s: float,
                     server: Server) -> dict[str, Any]:  # fmt: skip
    """The batch object once terminal (or the last one seen at the timeout)."""
    obj: dict[str, Any] = {}
    t = time.perf_counter()
    for _ in range(int(timeout_s) + 1):
        if server.proc.poll() is not None:
            obj["_server_exited"] = server.proc.returncode
            return obj
        with contextlib.suppress(httpx.HTTPError):
            r = await c.get(f"/v1/batches/{batch_id}", timeout=CONTROL_TIMEOUT_S)
            if r.status_code == 200:
                obj = r.json()
                if obj["status"] in TERMINAL:
                    return obj
        if time.perf_counter() - t > timeout_s:
            break
        await asyncio.sleep(1.0)
    return obj


async def count_rows(c: httpx.AsyncClient, obj: dict[str, Any]) -> tuple[Counter, int, int]:
    """(custom_id counts over the output and error files, output rows, error rows)."""
    ids: Counter = Counter()
    sizes = []
    for key in ("output_file_id", "error_file_id"):
        n = 0
        if obj.get(key):
            r = await c.get(f"/v1/files/{obj[key]}/content", timeout=120)
            r.raise_for_status()
            for line in r.text.splitlines():
                if line.strip():
                    ids[json.loads(line)["custom_id"]] += 1
                    n += 1
        sizes.append(n)
    return ids, sizes[0], sizes[1]


# ---------------------------------------------------------------- one run


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


async def warm_up(c: httpx.AsyncClient, plan: Plan, rec: Record) -> None:
    """One stream and one small embeddings request, so first-call costs are not measured."""
    await one_stream(c, replace(plan, stream_max_tokens=4), -1, 0, rec)
    r = await c.post("/v1/embeddings", json={"model": "default", "input": ["warm up"]},
                     timeout=plan.embed_timeout_s)  # fmt: skip
    r.raise_for_status()


async def drive(server: Server, plan: Plan, max_rss_gb: float) -> Outcome:
    ready_s = await wait_ready(server, plan.start_timeout_s)
    rec = Record()
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    # separate pools: a stream holding a connection never delays a control request's send
    async with httpx.AsyncClient(base_url=server.base, limits=limits) as ctl, \
            httpx.AsyncClient(base_url=server.base, limits=limits) as load:  # fmt: skip
        await warm_up(load, plan, rec)
        if rec.failures:
            raise RuntimeError(f"warm-up failed: {rec.failures[0]}")
        rec.ttft.clear()
        rec.itl.clear()
        rec.stream_requests = rec.stream_tokens = 0
        t_create = time.perf_counter()
        batch_id = await create_batch(load, plan)
        rec.t0 = time.perf_counter()  # the load starts with the batch
        stop, streams_stop = asyncio.Event(), asyncio.Event()
        background = [
            asyncio.create_task(sample_rss(server, rec, stop, plan, max_rss_gb)),
            *(asyncio.create_task(poll(ctl, p, batch_id, rec, stop, plan))
              for p in POLLERS),
        ]  # fmt: skip
        work = [
            *(asyncio.create_task(stream_client(load, plan, i, rec, streams_stop))
              for i in range(plan.streams)),
            asyncio.create_task(embeddings(load, plan, rec)),
        ]  # fmt: skip
        batch = await wait_batch(ctl, batch_id, plan.batch_timeout_s, server)
        if batch.get("status") not in TERMINAL and "_server_exited" not in batch:
            # too slow: cancel, so the check below still sees every row (unrun ones get a
            # batch_cancelled line in the error file)
            rec.fail("batch", "timeout", f"not done in {plan.batch_timeout_s:.0f} s "
                     f"({json.dumps(batch.get('request_counts'))}); cancelled")  # fmt: skip
            await ctl.post(f"/v1/batches/{batch_id}/cancel", timeout=CONTROL_TIMEOUT_S)
            batch = await wait_batch(ctl, batch_id, CANCEL_TIMEOUT_S, server)
        batch_wall_s = time.perf_counter() - t_create
        streams_stop.set()  # the streams ran while the batch did; let the current round end
        await asyncio.gather(*work)
        load_s = rec.now()
        stop.set()
        await asyncio.gather(*background)
        if "_server_exited" in batch:
            rec.fail("serve", "exited", f"exit code {batch['_server_exited']}")
        ids, out_rows, err_rows = Counter(), 0, 0
        if batch.get("status") in ("completed", "cancelled"):
            ids, out_rows, err_rows = await count_rows(ctl, batch)
        if batch.get("status") != "completed":
            rec.fail("batch", "not completed", f"status {batch.get('status')!r}")
    return Outcome(plan, rec, batch, batch_wall_s, load_s, ids, out_rows, err_rows, ready_s)


# ---------------------------------------------------------------- the report


@dataclass(frozen=True)
class Target:
    name: str
    measured: str
    met: bool
    hard: bool  # enforced by --quick


def _ms(s: float) -> str:
    return "n/a" if s != s else f"{s * 1000:.0f} ms" if s >= 0.01 else f"{s * 1000:.1f} ms"


def rss_flat(rss: list[tuple[float, int]]) -> tuple[float, float, float] | None:
    """(middle third's median MB, last third's median MB, % change): the first third is warm-up."""
    if len(rss) < 6:
        return None
    end = rss[-1][0]
    mid = [b for t, b in rss if end / 3 <= t < 2 * end / 3]
    last = [b for t, b in rss if t >= 2 * end / 3]
    if not mid or not last:
        return None
    m, la = statistics.median(mid) / 2**20, statistics.median(last) / 2**20
    return m, la, (la - m) / m * 100


def targets(o: Outcome) -> list[Target]:
    rec, n = o.rec, o.plan.batch
    out = []
    for p in POLLERS:
        xs = rec.latency.get(p.name, [])
        out.append(Target(f"{p.name} p99 < {_ms(P99_TARGET_S)}", _ms(_pct(xs, 99)),
                          bool(xs) and _pct(xs, 99) < P99_TARGET_S, False))  # fmt: skip
        top = max(xs, default=float("nan"))
        out.append(Target(f"{p.name} max < {MAX_TARGET_S:.0f} s", _ms(top),
                          bool(xs) and max(xs) < MAX_TARGET_S, False))  # fmt: skip
    kinds = Counter(f"{f.what}: {f.kind}" for f in rec.failures)
    failed = (o.batch.get("request_counts") or {}).get("failed", 0)
    err = ", ".join(f"{k} x{v}" for k, v in kinds.most_common(4)) or "none"
    out.append(Target("zero errors (non-2xx, exceptions, timeouts; failed batch rows)",
                      f"{len(rec.failures)} ({err}); failed rows {failed}",
                      not rec.failures and not failed, True))  # fmt: skip
    expected = {f"req-{i}" for i in range(n)}
    lost, dup = expected - set(o.ids), [k for k, v in o.ids.items() if v > 1]
    extra = set(o.ids) - expected
    out.append(Target(f"nothing lost or duplicated ({n} custom_ids, each once)",
                      f"{len(set(o.ids) & expected)} distinct; lost {len(lost)}, duplicated "
                      f"{len(dup)}, unknown {len(extra)}",
                      not lost and not dup and not extra, True))  # fmt: skip
    out.append(Target("no traceback in the server log", f"{len(o.tracebacks)}",
                      not o.tracebacks, True))  # fmt: skip
    flat = rss_flat(rec.rss)
    out.append(Target(f"memory flat after warm-up (last third's median RSS within "
                      f"{RSS_FLAT_PCT:.0f}% of the middle third's)",
                      "n/a" if flat is None
                      else f"{flat[0]:.0f} → {flat[1]:.0f} MB ({flat[2]:+.1f}%)",
                      flat is not None and flat[2] <= RSS_FLAT_PCT, False))  # fmt: skip
    return out


def _machine() -> str:
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs, load average (1/5/15 min) {load}"


def _commit() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "batchmlx"],
                               capture_output=True, text=True, timeout=10,
                               cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + (" (batchmlx/ modified)" if dirty else "")


def report(o: Outcome, *, quick: bool, database: str, machine_start: str, wall_s: float) -> str:
    rec, plan = o.rec, o.plan
    tg = targets(o)
    lines = [
        f"# Load test of `batchmlx serve` (`python -m benchmarks.load_serve{' --quick' * quick}`)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {_commit()}, database "
        f"{database}, model `default`. Machine: at start {machine_start}; at end {_machine()} "
        "(shared with other processes, as it was).",
        "",
        f"Load: a {plan.batch}-request chat batch (max_tokens {plan.batch_max_tokens}) through "
        f"the Files and Batches APIs; {plan.streams} concurrent streamed chats (max_tokens "
        f"{plan.stream_max_tokens}, up to {plan.rounds} rounds each, {plan.stream_gap_s:g} s "
        f"apart, while the batch runs); one embeddings request of {plan.embed_inputs} inputs "
        f"{plan.embed_after_s:g} s in; pollers at a fixed rate, open-loop (a polled request "
        f"unanswered after {plan.control_timeout_s:g} s is a timeout error). Server ready in "
        f"{o.ready_s:.1f} s; batch created → {o.batch.get('status')} in {o.batch_wall_s:.1f} s; "
        f"the whole run {wall_s:.0f} s.",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        *(f"| {t.name} | {t.measured} | {'met' if t.met else '**not met**'} |" for t in tg),
        "",
        "| control endpoint | rate | answered | p50 | p99 | max | skipped slots |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in POLLERS:
        xs = rec.latency.get(p.name, [])
        lines.append(f"| {p.name} | {p.hz:g}/s | {len(xs)} | {_ms(_pct(xs, 50))} | "
                     f"{_ms(_pct(xs, 99))} | {_ms(max(xs, default=float('nan')))} | "
                     f"{rec.skipped[p.name]} |")  # fmt: skip
    lines += [
        "",
        "| streams | requests done | tokens | TTFT p50 | TTFT p99 | TTFT max | inter-token p50 "
        "| inter-token p99 | inter-token max |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {plan.streams} | {rec.stream_requests} | {rec.stream_tokens} | "
        f"{_ms(_pct(rec.ttft, 50))} | {_ms(_pct(rec.ttft, 99))} | "
        f"{_ms(max(rec.ttft, default=float('nan')))} | {_ms(_pct(rec.itl, 50))} | "
        f"{_ms(_pct(rec.itl, 99))} | {_ms(max(rec.itl, default=float('nan')))} |",
        "",
        f"Embeddings request ({plan.embed_inputs} inputs): "
        + ("no answer" if rec.embed_s is None else f"answered in {rec.embed_s:.1f} s")
        + ".",
        f"Batch rows: {o.output_rows} in the output file, {o.error_rows} in the error file; "
        f"request_counts {json.dumps(o.batch.get('request_counts'))}.",
        f"Server stop (SIGTERM): exited after {o.stop_s:.1f} s, code {o.stop_code} "
        f"({'graceful: the log says the shutdown completed' if o.graceful else 'NOT graceful'}"
        "; uvicorn re-raises the SIGTERM it caught, hence -15).",
        "",
        *_rss_lines(rec.rss, rec.mlx),
    ]
    if rec.slow:
        rec.slow.sort()
        lines += [
            "",
            f"Control requests slower than {SLOW_S * 1000:.0f} ms (sent at, since "
            "the load started; the first 20): "
            + "; ".join(f"{at:.1f} s {what} {_ms(dt)}" for at, what, dt in rec.slow[:20])
            + ".",
        ]
    if rec.failures:
        lines += ["", "Errors (the first 20):", ""]
        lines += [f"- {f.at_s:.1f} s, {f.what}: {f.kind}: {f.detail}" for f in rec.failures[:20]]
    if o.tracebacks:
        lines += ["", "Tracebacks in the server log (the line after each):", ""]
        lines += [f"- `{t.strip()}`" for t in o.tracebacks[:10]]
    return "\n".join(lines) + "\n"


def _rss_lines(rss: list[tuple[float, int]],
               mlx: list[tuple[float, dict[str, float]]] = ()) -> list[str]:  # fmt: skip
    if not rss:
        return ["RSS: no samples."]
    step = max(1, len(rss) // 12)
    pts = rss[::step] + ([rss[-1]] if (len(rss) - 1) % step else [])
    peak = max(b for _, b in rss) / 2**20
    lines = [
        f"RSS of the serve process (MB; {len(rss)} samples, peak {peak:.0f}), and MLX's "
        "active and cached memory from the nearest /metrics scrape (MB):",
        "",
        "| s | " + " | ".join(f"{t:.0f}" for t, _ in pts) + " |",
        "|---|" + "---|" * len(pts),
        "| RSS | " + " | ".join(f"{b / 2**20:.0f}" for _, b in pts) + " |",
    ]
    for kind in ("active", "cache") if mlx else ():
        near = [min(mlx, key=lambda m, t=t: abs(m[0] - t))[1].get(kind) for t, _ in pts]
        lines.append(
            f"| MLX {kind} | "
            + " | ".join("?" if v is None else f"{v / 2**20:.0f}" for v in near)
            + " |"
        )
    return lines


def _database_name(url: str | None) -> str:
    if not url:
        return "SQLite (fresh $BATCHMLX_HOME)"
    return urlsplit(url).scheme.split("+")[0] or "?"  # never the URL itself: it may hold a password


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short run; exit 1 on a correctness miss")
    ap.add_argument("--database-url", help="the queue (default: SQLite in a fresh home)")
    ap.add_argument("--out", type=Path, help="write the report here too")
    ap.add_argument("--batch", type=int, help="override the batch's size")
    ap.add_argument("--max-rss-gb", type=float, default=MAX_RSS_GB,
                    help="kill the server (a failed run) above this RSS")  # fmt: skip
    ap.add_argument("--keep-log", type=Path, help="copy the server's log here")
    ap.add_argument("--control-timeout", type=float, default=CONTROL_TIMEOUT_S,
                    help="seconds before a polled request counts as a timeout error")  # fmt: skip
    a = ap.parse_args()
    plan = QUICK if a.quick else Plan()
    plan = replace(plan, control_timeout_s=a.control_timeout)
    if a.batch:
        plan = replace(plan, batch=a.batch)
    out = a.out or (None if a.quick else Path(__file__).parent / "RESULTS-load.md")
    machine_start = _machine()
    signal.signal(signal.SIGTERM, _interrupt)  # a stopped run stops its server too (finally)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="batchmlx-load-") as tmp:
        server = start_server(Path(tmp), a.database_url)
        # the hard limit holds even if this process's loop were stuck: a thread kills the server
        killer = threading.Timer(plan.hard_timeout_s + 60, server.proc.kill)
        killer.daemon = True
        killer.start()
        try:
            o = asyncio.run(
                asyncio.wait_for(drive(server, plan, a.max_rss_gb), plan.hard_timeout_s)
            )
            o.stop_code, o.stop_s = server.stop()
        except (Exception, TimeoutError) as exc:  # noqa: BLE001 - any failure: report, exit 2
            server.stop(10)
            tail = server.log.read_text(errors="replace").splitlines()[-30:]
            print(f"load test did not finish: {type(exc).__name__}: {exc}\n"
                  "server log (last 30 lines):\n" + "\n".join(tail), file=sys.stderr)  # fmt: skip
            return 2
        finally:
            killer.cancel()
            server.stop(10)  # already stopped, or (Ctrl-C) it must not outlive the run
            if a.keep_log:
                shutil.copyfile(server.log, a.keep_log)
        o.tracebacks = server.tracebacks()
        o.graceful = "Application shutdown complete" in server.log.read_text(errors="replace")
    text = report(o, quick=a.quick, database=_database_name(a.database_url),
                  machine_start=machine_start, wall_s=time.perf_counter() - t)  # fmt: skip
    print(text)
    if out is not None:
        out.write_text(text)
        print(f"written to {out}", file=sys.stderr)
    # quick: the correctness targets decide; a full run: every target
    miss = [x.name for x in targets(o) if not x.met and (x.hard or not a.quick)]
    if miss:
        print("target(s) not met: " + "; ".join(miss), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: the server was stopped in main
        print(f"load test interrupted ({exc or 'Ctrl-C'}); server stopped", file=sys.stderr)
        sys.exit(130)
