"""A 32-token chat on the default model at a given engine thread count, with and without busy
neighbours (issue 21's row: 35-46 s at the old defaults next to other processes, 3.8-4.0 s with
OPENBLAS_NUM_THREADS=1). Each measurement is a fresh process on the fast BLAS; the neighbours are
plain Python busy loops, bounded in time.

    python -m benchmarks.threads_neighbours [--threads 1 2 auto] [--neighbours 0 2] [--repeat 2]
                                            [--width 1]

`auto` is the default choice (engine/host/threads.py: the CPUs other processes leave free, looked
at again between steps); `--width N` runs N chats at once (tok/s then says what 2 threads buy).

Measured on a quiet 2-core machine, 2026-12-01 19:32 UTC (load average 0.4 at the start; best
of 2 runs, warm; neighbours are busy loops):

| extra busy neighbours | threads (used) | 32 x 32-token chats: tok/s | 1 x 32-token chat: s |
|---|---|---|---|
| 0 | 1 | 274.5 | 1.93 |
| 0 | 2 | 372.4 | 1.75 |
| 0 | auto (2) | 360.6 | 1.57 |
| 1 | 1 | 256.6 | |
| 1 | 2 | 171.0 | |
| 1 | auto (1) | 234.3 | |
| 2 | 1 | | 3.11 |
| 2 | 2 | | 6.91, 12.82 |
| 2 | auto (1) | | 3.35 |

Earlier, on the same machine already at a load average of 8-12 from other work: a 32-token chat
took 32.17 s on 2 threads and 6.52 s on 1; with two more neighbours 59.74 s and 10.82 s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
from batchmlx.engine.host.fast_blas import ensure_fast_blas
ensure_fast_blas()
from batchmlx.engine.host.threads import apply_threads, choose_threads
from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.worker.build import build_engine
from tests.e2e.helpers import model_cache_dir
threads = None if sys.argv[1] == "auto" else int(sys.argv[1])
width = int(sys.argv[3])
m = build_engine("default", cache_dir=model_cache_dir(), settings=EngineSettings(threads=threads))
tok = m.translator.tok
prompt = tok.encode(tok.apply_chat_template(
    [{"role": "user", "content": "Write a short poem about the sea."}],
    add_generation_prompt=True, tokenize=False))
def once(i):
    for j in range(width):
        m.engine.add(GenerationRequest(f"r{i}-{j}", list(prompt), SamplingParams(max_tokens=32,
                     temperature=0.0)))
    t = time.perf_counter()
    n = 0
    while m.engine.has_unfinished():
        for out in m.engine.step():
            n += len(out.token_ids)
        m.threads.review()  # as the worker does between steps
    return time.perf_counter() - t, n
once(0)  # warm-up
runs = [once(i + 1) for i in range(int(sys.argv[2]))]
print(json.dumps({"threads": m.threads.threads, "seconds": [round(s, 2) for s, _ in runs],
                  "tokens": runs[-1][1]}))
"""

BUSY = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass\n"


def measure(
    threads: str, neighbours: int, repeat: int, width: int = 1, limit_s: float = 300
) -> dict:
    busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(s=limit_s)])
            for _ in range(neighbours)]  # fmt: skip
    try:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD, threads, str(repeat), str(width)],
                             capture_output=True, text=True, timeout=limit_s)  # fmt: skip
        if out.returncode != 0:
            raise SystemExit(out.stderr[-2000:])
        row = json.loads(out.stdout.strip().splitlines()[-1])
        row |= {"neighbours": neighbours, "process_s": round(time.perf_counter() - t0, 1)}
        return row
    finally:
        for p in busy:
            p.kill()
            p.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", nargs="+", default=["1", "2", "auto"])
    ap.add_argument("--neighbours", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--width", type=int, default=1)
    args = ap.parse_args()
    print(f"| neighbours | threads (used) | {args.width} x 32-token chats, s (each run) | tok/s |")
    print("|---|---|---|---|")
    for k in args.neighbours:
        for n in args.threads:
            row = measure(n, k, args.repeat, args.width)
            runs = ", ".join(f"{s:.2f}" for s in row["seconds"])
            rate = row["tokens"] / min(row["seconds"])
            print(f"| {k} | {n} ({row['threads']}) | {runs} | {rate:.1f} |", flush=True)


if __name__ == "__main__":
    main()
