"""A new model's first start against its warm ones, as a user meets them (issue 47: "the first
start of a new model should not take twice a warm one").

    python -m benchmarks.first_start [--model 1.7b] [--requests 8] [--max-tokens 32]
                                     [--warm 2] [--out FILE]

`batchmlx submit --wait` then `results` as a fresh process each (benchmarks/peers/run_peer.py's
`run_batchmlx`, defaults), on a model cache folder of its own, empty at the first run: that
start packs the weights for the host GEMMs and writes them to the cache (behind the start:
engine/host/weights_cache.py); the warm ones map the file. Prints a Markdown table: whole
process, ready (spawn to the load's log line), steady tok/s, peak RSS, and the cache's size
after each run, with the first start's wall time over the warm runs' median.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import benchmarks.whole_process as whole_process
from benchmarks.peers import run_peer


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=whole_process.REPO,
                         capture_output=True, text=True)  # fmt: skip
    return out.stdout.strip() or "unknown"


def measure(model: str, requests: int, max_tokens: int, warm: int) -> list[str]:
    wl = run_peer.workload("unique", requests=requests, max_tokens=max_tokens)
    cache = Path(tempfile.mkdtemp(prefix="first-start-cache-"))
    rows, walls = [], []
    load = [f"{os.getloadavg()[0]:.1f}"]
    try:
        for k in range(1 + warm):
            run = run_peer.run_batchmlx(wl, model, cache=cache)
            size = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
            walls.append(run.wall_s)
            rows.append(f"| {'first' if k == 0 else f'warm {k}'} | {run.wall_s:.1f} | "
                        f"{run.load_s:.1f} | {run.steady_tok_s:.1f} | {run.peak_rss_mb:,.0f} | "
                        f"{size / 1e9:.2f} GB |")  # fmt: skip
            load.append(f"{os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    ratio = walls[0] / statistics.median(walls[1:]) if warm else float("nan")
    return [
        f"# A new model's first start against warm ones (`python -m benchmarks.first_start "
        f"--model {model}`)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {_commit()}, {_cpu()}, "
        f"{os.cpu_count()} CPUs; load average (1 min) {' -> '.join(load)} (before and after "
        f"each run). Model `{model}`, {requests} chats x {max_tokens} new tokens, defaults, a "
        "fresh process each; the model cache empty before the first.",
        "",
        "| run | whole process (s) | ready (s) | steady tok/s | peak RSS (MB) | cache after |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"First start / warm (median): **{ratio:.2f}x** (issue 47's target: <= 1.5x).",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="1.7b")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warm", type=int, default=2)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    text = "\n".join(measure(a.model, a.requests, a.max_tokens, a.warm)) + "\n"
    print(text)
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
