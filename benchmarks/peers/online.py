"""Online serving beside llama.cpp's `llama-server` (issue 23, item 4): streamed chats' time to
first token and inter-token latency at 1, 8 and 32 concurrent streams, alone and with a batch
running underneath.

    python -m benchmarks.peers.online [--quick] [--out PATH]

Each system is a real server on 127.0.0.1: `batchmlx serve` with its defaults (this tree on
PYTHONPATH, the model from $BATCHMLX_CACHE_DIR, default ~/.cache/batchmlx-test), and
`llama-server` (benchmarks/peers/setup.py's build) on the same weights as the peers' section
(`run_peer._default_quant`: Q4_1), continuous batching, threads = the CPUs this process may
use. Each stream sends its requests one after another (distinct questions, the same for both
systems, greedy, `max_tokens` 32, `stream: true`) through load_serve.py's `one_stream`: TTFT =
send to the first chunk with text, ITL = the gaps between text chunks (one token a chunk on
both servers). tok/s per stream = its text chunks over the time its requests were open.

With a batch underneath: batchmlx runs a real batch (Files + Batches API, 256 chats x 32
tokens) while the streams run; llama-server has no batch API, so the same 256 requests go to it
non-streamed, all at once, at most LLAMA_MAX_SEQ less the streams in flight (llama.cpp's slots
at most 256), so that a stream never waits for a slot. Either batch starts `settle_s` before
the streams; how far it had got when they ended is in the report. Writes
benchmarks/RESULTS-online-peers.md (a full run) or `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson

from benchmarks.load_plan import HOST, Plan, Record, _pct
from benchmarks.load_report import _commit, _machine, _ms
from benchmarks.load_serve import (
    Server,
    batch_lines,
    create_batch,
    httpx,
    one_stream,
    start_server,
    wait_batch,
    wait_ready,
)
from benchmarks.peers.models import gguf_type, path_for
from benchmarks.peers.run_peer import (
    _default_quant,
    _free_port,
    _prompt_lengths,
    _threads,
    _tokenizer,
    llama_server_cmd,
)
from benchmarks.peers.setup import ensure

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "benchmarks" / "RESULTS-online-peers.md"
BATCH_QUESTION = "Tell story number {i}."  # long answers: every batch row runs its 32 tokens
# llama-server with the peers' threads (the CPUs this process may use), and with one: on a
# shared machine ggml's spinning thread team stalls when a neighbour holds a core, which
# batchmlx avoids by counting the free CPUs (batchmlx/engine/host/threads.py)
SYSTEMS = ("batchmlx", "llama", "llama-1t")
LLAMAS = SYSTEMS[1:]
LLAMA_MAX_SEQ = 256  # llama.cpp's most slots (LLAMA_MAX_SEQ): -np 257 exits at start
NAMES = {"batchmlx": "batchmlx serve", "llama": "llama-server",
         "llama-1t": "llama-server -t 1"}  # fmt: skip


def log(msg: str) -> None:
    print(f"[online-peers] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Setup:
    streams: tuple[int, ...] = (1, 8, 32)
    rounds: int = 6  # each stream's requests, one after another
    max_tokens: int = 32
    batch: int = 256  # requests of the batch underneath
    batch_max_tokens: int = 32
    stagger_s: float = 0.05  # stream i starts i x this late, as clients arrive
    settle_s: float = 2.0  # the batch runs this long before the streams start
    think_s: float = 0.0  # a stream's pause between its requests (a user reading the answer)
    alone_slots: int = 64  # llama-server's slots with no batch
    timeout_s: float = 900.0  # a stream request, a batch


QUICK = Setup(streams=(1, 8), rounds=2, batch=32)


@dataclass
class Row:
    system: str  # batchmlx | llama
    streams: int
    underneath: bool  # a batch ran while the streams did
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tok_s: list[float] = field(default_factory=list)  # one per stream
    requests: int = 0
    chunks: int = 0
    failures: list[str] = field(default_factory=list)
    batch_note: str = ""
    wall_s: float = 0.0  # the streams' first send to their last chunk
    batch_s: float = 0.0  # underneath: the batch's creation to its completion, streams beside
    batch_alone_s: float = 0.0  # underneath: the same batch alone on the same server


@dataclass
class Info:
    """What each system computes in and with, for the report's header."""

    precision: dict[str, str] = field(default_factory=dict)
    threads: dict[str, str] = field(default_factory=dict)
    version: str = ""
    failed: list[str] = field(default_factory=list)  # runs that did not finish


# -- the servers ------------------------------------------------------------------------------


def _llama_per_slot(setup: Setup) -> int:
    """Context per slot: the longest prompt of either workload, its answer and a margin."""
    big = 10**6  # more digits than any stream, round or request number
    questions = [f"Stream {big}, round {big}: tell me a fact.", BATCH_QUESTION.format(i=big)]
    reqs = [("", [{"role": "user", "content": q}]) for q in questions]
    return max(_prompt_lengths(_tokenizer("default"), reqs)) + setup.max_tokens + 64


@contextlib.asynccontextmanager
async def serving(system: str, setup: Setup, underneath: bool, info: Info,
                  home: Path) -> AsyncIterator[Server]:  # fmt: skip
    if system == "batchmlx":
        server = start_server(home, None)
    else:
        inst = ensure("llama")
        gguf = Path(path_for("default", _default_quant("default")))
        slots = _llama_slots(setup) if underneath else setup.alone_slots
        port, threads = _free_port(), 1 if system == "llama-1t" else _threads()
        logf = home / "server.log"
        with logf.open("wb") as out:
            cmd = llama_server_cmd(inst.server, gguf, port, slots, _llama_per_slot(setup),
                                   threads)  # fmt: skip
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        server = Server(proc, f"http://{HOST}:{port}", logf)
        info.precision[system] = f"{gguf_type(gguf)} ({gguf.name})"
        info.threads[system] = f"-t {threads} -tb {threads}"
        info.version = inst.version
    try:
        ready = await _ready(server, setup)
        log(f"{system}{' (batch underneath)' * underneath}: ready in {ready:.1f} s")
        if system == "batchmlx":
            info.precision[system], info.threads[system] = _bmx_info(server.log)
        yield server
    finally:
        server.stop()


async def _ready(server: Server, setup: Setup) -> float:
    """Up and answering (llama-server answers 503 while it loads), then two warm-up streams
    so first-call costs are not measured."""
    t = await wait_ready(server, setup.timeout_s)
    plan = _plan(setup)
    async with httpx.AsyncClient(base_url=server.base) as c:
        rec = Record()
        for k in range(2):
            await one_stream(c, plan, -1, k, rec)
    if rec.failures:
        raise RuntimeError(f"warm-up failed: {rec.failures[0]}")
    return t


def _bmx_info(logf: Path) -> tuple[str, str]:
    lines = logf.read_text(errors="replace").splitlines()
    weights = next((ln.split(": weights as ", 1)[1].split(" on ", 1)[0] for ln in lines
                    if ": weights as " in ln), "see the server log")  # fmt: skip
    threads = [ln.split("engine threads: ", 1)[1] for ln in lines if "engine threads: " in ln]
    return weights, threads[-1] if threads else "chosen at start (batchmlx/engine/host/threads.py)"


def _plan(setup: Setup) -> Plan:
    return replace(Plan(), stream_max_tokens=setup.max_tokens, stream_timeout_s=setup.timeout_s,
                   batch=setup.batch, batch_max_tokens=setup.batch_max_tokens)  # fmt: skip


# -- the load ---------------------------------------------------------------------------------


async def streams(base: str, n: int, setup: Setup, row: Row, first_round: int) -> None:
    """`n` concurrent streams of `setup.rounds` requests each; the figures land in `row`."""
    plan = _plan(setup)
    recs = [Record() for _ in range(n)]
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(base_url=base, limits=limits) as c:

        async def client(i: int) -> float:
            await asyncio.sleep(i * setup.stagger_s)
            open_s = 0.0
            for k in range(setup.rounds):
                if k and setup.think_s:
                    await asyncio.sleep(setup.think_s)
                t = time.perf_counter()
                await one_stream(c, plan, i, first_round + k, recs[i])
                open_s += time.perf_counter() - t
            return recs[i].stream_tokens / open_s if open_s else 0.0

        row.tok_s = list(await asyncio.gather(*(client(i) for i in range(n))))
    for r in recs:
        row.ttft += r.ttft
        row.itl += r.itl
        row.requests += r.stream_requests
        row.chunks += r.stream_tokens
        row.failures += [f"{f.what}: {f.kind}: {f.detail}" for f in r.failures]


class BmxBatch:
    """A real batch through the Files and Batches APIs."""

    def __init__(self, c: httpx.AsyncClient, server: Server, setup: Setup) -> None:
        self.c, self.server, self.setup = c, server, setup
        self.id, self.t0, self.seconds = "", 0.0, 0.0

    async def start(self) -> None:
        self.t0 = time.perf_counter()
        self.id = await create_batch(self.c, _plan(self.setup), BATCH_QUESTION)
        for _ in range(600):  # validated and picked up by the worker
            if (await self.c.get(f"/v1/batches/{self.id}")).json()["status"] != "validating":
                break
            await asyncio.sleep(0.1)

    async def progress(self) -> str:
        counts = (await self.c.get(f"/v1/batches/{self.id}")).json()["request_counts"]
        return f"{counts['completed'] + counts['failed']}/{counts['total']}"

    async def finish(self) -> str:
        obj = await wait_batch(self.c, self.id, self.setup.timeout_s, self.server)
        self.seconds = time.perf_counter() - self.t0
        return f"{obj.get('status')} in {self.seconds:.1f} s"


class LlamaBatch:
    """The same requests, non-streamed, all at once (llama-server has no batch API), at most
    `in_flight` at a time, so that a stream never waits for a free slot."""

    def __init__(self, c: httpx.AsyncClient, setup: Setup, in_flight: int) -> None:
        self.c, self.setup = c, setup
        self.gate = asyncio.Semaphore(in_flight)
        self.tasks: list[asyncio.Task] = []
        self.t0 = self.seconds = 0.0

    async def start(self) -> None:
        self.t0 = time.perf_counter()
        bodies = [
            orjson.loads(line)["body"]
            for line in batch_lines(
                self.setup.batch, self.setup.batch_max_tokens, BATCH_QUESTION
            ).splitlines()
        ]
        self.tasks = [asyncio.create_task(self._one(b)) for b in bodies]

    async def _one(self, body: dict) -> httpx.Response:
        async with self.gate:
            return await self.c.post("/v1/chat/completions", json=body,
                                     timeout=self.setup.timeout_s)  # fmt: skip

    async def progress(self) -> str:
        return f"{sum(t.done() for t in self.tasks)}/{len(self.tasks)}"

    async def finish(self) -> str:
        done = await asyncio.gather(*self.tasks, return_exceptions=True)
        bad = sum(1 for r in done if isinstance(r, Exception) or r.status_code != 200)
        state = "completed" if not bad else f"{bad} failed"
        self.seconds = time.perf_counter() - self.t0
        return f"{state} in {self.seconds:.1f} s"


def _llama_slots(setup: Setup) -> int:
    """llama-server's slots with a batch underneath: the batch and the streams, at most
    llama.cpp's LLAMA_MAX_SEQ."""
    return min(setup.batch + max(setup.streams), LLAMA_MAX_SEQ)


def _batch_in_flight(setup: Setup) -> int:
    return min(setup.batch, LLAMA_MAX_SEQ - max(setup.streams))


async def measure(system: str, setup: Setup, underneath: bool, info: Info) -> list[Row]:
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"online-{system}-") as tmp:
        async with serving(system, setup, underneath, info, Path(tmp)) as server:
            limits = httpx.Limits(max_connections=setup.batch + 16)
            async with httpx.AsyncClient(base_url=server.base, limits=limits,
                                         timeout=60) as c:  # fmt: skip

                def batch() -> BmxBatch | LlamaBatch:
                    return BmxBatch(c, server, setup) if system == "batchmlx" else LlamaBatch(
                        c, setup, _batch_in_flight(setup))  # fmt: skip

                alone_s = 0.0
                if underneath:  # the batch's own throughput: the same batch with no streams
                    solo = batch()
                    await solo.start()
                    log(f"{system}: the batch alone: {await solo.finish()}")
                    alone_s = solo.seconds
                for k, n in enumerate(setup.streams):
                    row = Row(system, n, underneath, batch_alone_s=alone_s)
                    bg = None
                    if underneath:
                        bg = batch()
                        await bg.start()
                        await asyncio.sleep(setup.settle_s)
                    t = time.perf_counter()
                    # distinct questions in every run: no answer comes from a cache
                    await streams(server.base, n, setup, row, 1000 * (k + 1))
                    wall = row.wall_s = time.perf_counter() - t
                    if bg is not None:
                        at_end = await bg.progress()
                        row.batch_note = f"{at_end} done when the streams ended; " + (
                            await bg.finish()
                        )
                        row.batch_s = bg.seconds
                    log(f"{system} {n} streams{' + batch' * underneath}: {row.requests} "
                        f"requests in {wall:.1f} s, TTFT p50 {_ms(_pct(row.ttft, 50))}, ITL p50 "
                        f"{_ms(_pct(row.itl, 50))}; {row.batch_note} (load "
                        f"{os.getloadavg()[0]:.2f})")  # fmt: skip
                    rows.append(row)
    return rows


# -- the report -------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> str:
    return "n/a" if not (a == a and b == b and b) else f"{a / b:.2f}"


FIGS = (("TTFT p50", "ttft", 50), ("TTFT p99", "ttft", 99), ("ITL p50", "itl", 50),
        ("ITL p99", "itl", 99))  # fmt: skip


def _fig(row: Row, attr: str, q: float) -> float:
    return _pct(getattr(row, attr), q)


def table(rows: list[Row]) -> list[str]:
    head = ["streams", "system", "requests", "text chunks",
            *(f for f, _, _ in FIGS), "tok/s per stream (median)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in sorted({r.streams for r in rows}):
        by = {r.system: r for r in rows if r.streams == n}
        for s in SYSTEMS:
            if s in by:
                r = by[s]
                tok = _pct(r.tok_s, 50)
                lines.append(f"| {n} | {NAMES[s]} | {r.requests} | {r.chunks} | "
                             + " | ".join(_ms(_fig(r, a, q)) for _, a, q in FIGS)
                             + f" | {tok:.1f} |")  # fmt: skip
        for peer in (p for p in LLAMAS if "batchmlx" in by and p in by):
            b, ll = by["batchmlx"], by[peer]
            lines.append(f"| {n} | **batchmlx / {NAMES[peer]}** | | | "
                         + " | ".join(_ratio(_fig(b, a, q), _fig(ll, a, q)) for _, a, q in FIGS)
                         + f" | {_ratio(_pct(b.tok_s, 50), _pct(ll.tok_s, 50))} |")  # fmt: skip
    return lines


def target(rows: list[Row], peer: str, n: int = 8) -> tuple[str, bool] | None:
    by = {r.system: r for r in rows if r.streams == n}
    if "batchmlx" not in by or peer not in by:
        return None
    b, ll = by["batchmlx"], by[peer]
    parts, ok = [], True
    for name, attr in (("TTFT p50", "ttft"), ("ITL p50", "itl")):
        x, y = _fig(b, attr, 50), _fig(ll, attr, 50)
        ok = ok and x <= y
        parts.append(f"{name} {_ms(x)} vs {_ms(y)}")
    return "; ".join(parts), ok


def tail_targets(rows: list[Row], setup: Setup) -> list[str]:
    """Issue 49's targets for batchmlx: with the batch underneath, TTFT p99 and ITL p99 within
    2x the same streams alone; one stream alone, ITL p50 at or below llama-server's; the
    batch's throughput lost to the streams no more than their share of the tokens made while
    it ran (the streams' tokens in its window taken at their mean rate)."""
    alone = {r.streams: r for r in rows if r.system == "batchmlx" and not r.underneath}
    under = {r.streams: r for r in rows if r.system == "batchmlx" and r.underneath}
    lines = []
    for n in sorted(set(alone) & set(under)):
        a, u = alone[n], under[n]
        parts, ok = [], True
        for name, attr in (("TTFT p99", "ttft"), ("ITL p99", "itl")):
            x, y = _fig(u, attr, 99), _fig(a, attr, 99)
            ok = ok and x == x and y == y and x <= 2 * y
            parts.append(f"{name} {_ms(x)} under against {_ms(y)} alone ({_ratio(x, y)}x)")
        lines.append(f"- {n} streams, p99 with the batch within 2x alone: {'; '.join(parts)}: "
                     f"**{'met' if ok else 'not met'}**")  # fmt: skip
    lone = [r for r in rows if r.streams == 1 and not r.underneath]
    by = {r.system: r for r in lone}
    if "batchmlx" in by and "llama" in by:
        x, y = _fig(by["batchmlx"], "itl", 50), _fig(by["llama"], "itl", 50)
        lines.append(f"- one stream alone, ITL p50 <= llama-server's: {_ms(x)} against "
                     f"{_ms(y)}: **{'met' if x <= y else 'not met'}**")  # fmt: skip
    batch_tokens = setup.batch * setup.batch_max_tokens
    for n, u in sorted(under.items()):
        if not (u.batch_s and u.batch_alone_s and u.wall_s):
            continue
        lost = max(0.0, 1 - u.batch_alone_s / u.batch_s)
        window = max(0.0, min(u.wall_s, u.batch_s - setup.settle_s))
        online = u.chunks * window / u.wall_s
        share = online / (online + batch_tokens)
        lines.append(f"- {n} streams, the batch's throughput lost <= the streams' share: "
                     f"{u.batch_alone_s:.1f} s alone, {u.batch_s:.1f} s beside them: {lost:.0%} "
                     f"lost against a {share:.0%} share ({online:.0f} of their tokens in its "
                     f"window): **{'met' if lost <= share else 'not met'}**")  # fmt: skip
    return lines


def report(rows: list[Row], setup: Setup, info: Info, *, quick: bool, machine_start: str,
           wall_s: float, title: str = "Online serving beside llama-server",
           level: int = 1) -> str:  # fmt: skip
    h = "#" * level
    lines = [
        f"{h} {title} (`python -m benchmarks.peers.online{' --quick' * quick}`)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {_commit()}, model "
        f"`default` (SmolLM2-135M-Instruct). Machine: at start {machine_start}; at end "
        f"{_machine()} (shared with other processes). The whole run {wall_s:.0f} s.",
        "",
        f"- batchmlx serve (defaults): weights {info.precision.get('batchmlx', '?')}; threads: "
        f"{info.threads.get('batchmlx', '?')}.",
        f"- llama-server ({info.version}): weights {info.precision.get('llama', '?')}; "
        f"{info.threads.get('llama', '?')} (the peers' threads: the CPUs this process may use) "
        f"and, as a second row, {info.threads.get('llama-1t', '?')}; --cont-batching, "
        f"-np {setup.alone_slots} alone, -np {_llama_slots(setup)} with the batch.",
        "",
        f"Each stream: {setup.rounds} streamed chat requests one after another (distinct "
        f"questions, the same for both systems; greedy, max_tokens {setup.max_tokens}); stream i "
        f"starts {setup.stagger_s:g} x i s late. TTFT = send to the first chunk with text; ITL "
        "= the gaps between text chunks; percentiles nearest-rank over every request (TTFT: "
        "streams x rounds samples) or gap; tok/s per stream = its text chunks over the time its "
        "requests were open. Ratios below 1: batchmlx quicker.",
        "",
        f"{h}# Alone",
        "",
        *table([r for r in rows if not r.underneath]),
        "",
        f"{h}# With a batch underneath",
        "",
        f"batchmlx: a real batch ({setup.batch} chats x {setup.batch_max_tokens} tokens, Files + "
        f"Batches API), created {setup.settle_s:g} s before the streams start (once it left "
        "`validating`). llama-server has no batch API: the same requests sent non-streamed, all "
        f"at once, {setup.settle_s:g} s before the streams, at most {_batch_in_flight(setup)} "
        f"at a time (llama.cpp's {LLAMA_MAX_SEQ} slots at most, less the streams: a stream never "
        "waits for a slot).",
        "",
        *table([r for r in rows if r.underneath]),
        "",
        *(
            f"- {NAMES[r.system]}, {r.streams} streams: batch {r.batch_note}."
            for r in rows
            if r.underneath
        ),  # fmt: skip
        "",
        f"{h}# Target: at 8 streams, TTFT p50 and ITL p50 <= llama-server's",
        "",
    ]
    for name, under in (("alone", False), ("with a batch underneath", True)):
        for peer in LLAMAS:
            t = target([r for r in rows if r.underneath == under], peer)
            if t:
                lines.append(f"- {name}, against {NAMES[peer]}: {t[0]}: "
                             f"**{'met' if t[1] else 'not met'}**")  # fmt: skip
    lines += [
        "",
        f"{h}# Targets: online work beside a batch (issue 49)",
        "",
        *tail_targets(rows, setup),
    ]
    fails = info.failed + [f"{NAMES[r.system]} {r.streams}: {f}" for r in rows
                           for f in r.failures]  # fmt: skip
    if fails:
        lines += ["", f"Errors ({len(fails)}; the first 10):", "", *(f"- {f}" for f in fails[:10])]
    return "\n".join(lines) + "\n"


# -- CLI --------------------------------------------------------------------------------------


async def run_all(setup: Setup, info: Info) -> list[Row]:
    rows = []
    for underneath in (False, True):
        for system in SYSTEMS:
            try:
                rows += await measure(system, setup, underneath, info)
            except Exception as exc:  # noqa: BLE001 - reported; the other runs go on
                log(f"{system}: FAILED: {type(exc).__name__}: {exc}")
                info.failed.append(f"{NAMES[system]}{' with the batch' * underneath}: "
                                   f"{type(exc).__name__}: {exc}")  # fmt: skip
    return rows


def section(quick: bool = False, out: Path | None = None, **heading: Any) -> list[str]:
    """The whole measurement as Markdown lines (written to `out` too, when given); `heading`:
    report()'s title and level."""
    setup = QUICK if quick else Setup()
    # the serve subprocess imports this tree
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)  # fmt: skip
    machine, t = _machine(), time.perf_counter()
    info = Info()
    rows = asyncio.run(run_all(setup, info))
    text = report(rows, setup, info, quick=quick, machine_start=machine,
                  wall_s=time.perf_counter() - t, **heading)  # fmt: skip
    if out is not None:
        out.write_text(text)
        log(f"written to {out}")
    return text.splitlines()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 and 8 streams, 2 requests each")
    ap.add_argument("--out", type=Path, help=f"default: {OUT.name} (a full run), none (--quick)")
    a = ap.parse_args(argv)
    lines = section(a.quick, a.out or (None if a.quick else OUT))
    print("\n".join(lines))
    return 1 if any(ln.startswith("Errors (") for ln in lines) else 0


if __name__ == "__main__":
    raise SystemExit(main())
