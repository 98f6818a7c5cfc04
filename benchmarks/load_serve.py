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
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import orjson

try:  # the openai SDK's HTTP client (a test dependency): httpx, published as httpx2 of late
    import httpx2 as httpx
except ImportError:  # pragma: no cover - an older environment
    import httpx  # type: ignore[no-redef]

from benchmarks.load_plan import (
    CANCEL_TIMEOUT_S,
    CONTROL_TIMEOUT_S,
    HOST,
    MAX_INFLIGHT,
    MAX_RSS_GB,
    POLLERS,
    QUICK,
    SLOW_S,
    TERMINAL,
    Outcome,
    Plan,
    Poller,
    Record,
)
from benchmarks.load_report import _database_name, _machine, report, targets

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
