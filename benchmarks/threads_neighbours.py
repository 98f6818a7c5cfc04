"""A 32-token chat on the default model at a given engine thread count, with and without busy
neighbours (issue 21's row: 35-46 s at the old defaults next to other processes, 3.8-4.0 s with
OPENBLAS_NUM_THREADS=1). Each measurement is a fresh process on the fast BLAS; the neighbours are
plain Python busy loops, bounded in time.

    python -m benchmarks.threads_neighbours [--threads 1 2] [--neighbours 0 2] [--repeat 2]

Measured (2 cores, already at a load average of 8-12 from other work; one run each, warm):

| extra busy neighbours | threads | 32-token chat, s |
|---|---|---|
| 0 | 2 (the old default: OpenBLAS's own, one per CPU) | 32.17 |
| 0 | 1 (the default now on 2 CPUs) | 6.52 |
| 2 | 2 | 59.74 |
| 2 | 1 | 10.82 |
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
from batchmlx.accel import ensure_fast_blas
ensure_fast_blas()
from batchmlx.threads import apply_threads, choose_threads
from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.worker.build import build_engine
from tests.e2e.helpers import model_cache_dir
threads = int(sys.argv[1])
choice = choose_threads(threads)
apply_threads(choice)
m = build_engine("default", cache_dir=model_cache_dir(), settings=EngineSettings(threads=threads))
tok = m.translator.tok
prompt = tok.encode(tok.apply_chat_template(
    [{"role": "user", "content": "Write a short poem about the sea."}],
    add_generation_prompt=True, tokenize=False))
def once(i):
    m.engine.add(GenerationRequest(f"r{i}", list(prompt), SamplingParams(max_tokens=32,
                 temperature=0.0)))
    t = time.perf_counter()
    n = 0
    while m.engine.has_unfinished():
        for out in m.engine.step():
            n = len(out.token_ids)
    return time.perf_counter() - t, n
once(0)  # warm-up
runs = [once(i + 1) for i in range(int(sys.argv[2]))]
print(json.dumps({"threads": threads, "seconds": [round(s, 2) for s, _ in runs],
                  "tokens": runs[-1][1]}))
"""

BUSY = "import time\nend = time.time() + {s}\nwhile time.time() < end: pass\n"


def measure(threads: int, neighbours: int, repeat: int, limit_s: float = 300) -> dict:
    busy = [subprocess.Popen([sys.executable, "-c", BUSY.format(s=limit_s)])
            for _ in range(neighbours)]  # fmt: skip
    try:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-c", CHILD, str(threads), str(repeat)],
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
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--neighbours", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    print("| neighbours | threads | 32-token chat, s (each run) |")
    print("|---|---|---|")
    for k in args.neighbours:
        for n in args.threads:
            row = measure(n, k, args.repeat)
            runs = ", ".join(f"{s:.2f}" for s in row["seconds"])
            print(f"| {k} | {n} | {runs} |", flush=True)


if __name__ == "__main__":
    main()
