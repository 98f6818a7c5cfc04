"""The grouped 4-bit kernel (engine/host/q4.py) against the grouped int8 one (q8.py), side by
side, per layer: `python -m benchmarks.q4_kernel [--model 135m,1.7b] [--rows 1,64] [--threads
1,2] [--json]`.

One transformer layer's GEMMs at each width M (rows), the shapes of benchmarks.int8_kernel,
random weights (q4: values 0..15 with a scale and bias per group of 32, as a Q4_1 file's). Each
path is what a host layer runs for `--dtype q4` and `--dtype int8`: one C call per GEMM that
quantizes its float32 input and splits the columns over the library's pool from SPLIT_MACS
multiply-adds. Columns: `q4` and `int8` as dispatched (AMX from their AMX_ROWS where it runs),
`q4 vnni` with AMX off. Timings as benchmarks.int8_kernel's: the best of `--trials`, the paths in
turn within each trial; at 1 thread in CPU time, at 2 in wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from batchmlx.engine.host import q4, q8
from benchmarks.int8_kernel import SHAPES, best_of, machine


@dataclass(frozen=True)
class Row:
    model: str
    rows: int
    threads: int
    q4_ms: float
    q4_vnni_ms: float
    int8_ms: float

    @property
    def ratio(self) -> float:
        """int8's time over q4's: above 1, q4 is faster."""
        return self.int8_ms / self.q4_ms


def _layers(model: str, rng: np.random.Generator) -> list[tuple[q4.Q4Weights, q8.Q8Weights]]:
    layers = []
    for _, n, k in SHAPES[model]:
        q = rng.integers(0, 16, (n, k), dtype=np.uint8)
        s = rng.uniform(0.001, 0.02, (n, k // q4.GROUP)).astype(np.float32)
        w4 = q4.Q4Weights.pack(q, s, -8 * s)
        w8 = q8.Q8Weights.pack((rng.standard_normal((n, k)) * 0.05).astype(np.float32))
        layers.append((w4, w8))
    return layers


def measure(model: str, rows: tuple[int, ...], threads: tuple[int, ...], trials: int) -> list[Row]:
    rng = np.random.default_rng(0)
    layers = _layers(model, rng)
    out: list[Row] = []
    for t in threads:
        for m in rows:
            calls: dict[str, list[Callable[[], None]]] = {"q4": [], "vnni": [], "int8": []}
            for w4, w8 in layers:
                x = rng.standard_normal((m, w4.k)).astype(np.float32)
                y = np.empty((m, w4.n), np.float32)

                def four(x=x, w=w4, y=y, t=t, amx=None):
                    q4.matmul(x, w, y, threads=t, use_amx=amx)

                def eight(x=x, w=w8, y=y, t=t):
                    q8.matmul(x, w, y, threads=t)

                calls["q4"].append(four)
                calls["vnni"].append(lambda f=four: f(amx=False))
                calls["int8"].append(eight)
            paths = {name: (lambda fs=fs: [f() for f in fs] and None) for name, fs in calls.items()}
            best = best_of(paths, trials, time.thread_time if t == 1 else time.perf_counter)
            out.append(Row(model, m, t, *(1e3 * best[p] for p in ("q4", "vnni", "int8"))))
            print(_line(out[-1]) if not _JSON else json.dumps(asdict(out[-1])), flush=True)
    return out


_JSON = False
HEADER = "| model | M | threads | q4 ms | q4 vnni ms | int8 ms | int8 / q4 |"


def _line(r: Row) -> str:
    return (
        f"| {r.model} | {r.rows} | {r.threads} | {r.q4_ms:.3f} | {r.q4_vnni_ms:.3f} | "
        f"{r.int8_ms:.3f} | {r.ratio:.2f}x |"
    )


def main(argv: list[str] | None = None) -> int:
    global _JSON
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="135m", help="comma-separated: " + ",".join(SHAPES))
    p.add_argument("--rows", default="1,8,64")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--json", action="store_true", help="JSON lines only")
    a = p.parse_args(argv)
    _JSON = a.json
    if not (q4.available() and q8.available()):
        raise SystemExit("the grouped kernels do not run here (see the log)")
    rows = tuple(int(v) for v in a.rows.split(","))
    threads = tuple(int(v) for v in a.threads.split(","))
    if not _JSON:
        print(f"{machine()} (start)\n\n{HEADER}\n|---|---|---|---|---|---|---|")
    for model in a.model.split(","):
        measure(model, rows, threads, a.trials)
    if not _JSON:
        print(f"\n{machine()} (end)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
