"""The 8-bit head (engine/host/head8.py) against the bf16 head through oneDNN, side by side:
`python -m benchmarks.head8 [--shape 135m,gemma3-1b] [--rows 1,8,64] [--threads 2] [--trials 30]`.

Each path is what a head's `SharedGemm.host` runs on float32 rows: `head8` rounds them to bf16
and runs the kernel (split over the GEMM pool's threads), `bf16` rounds them with oneDNN's
reorder and runs oneDNN's matmul. Random weights of the head's shape. Timings are medians (wall
clock, or `--clock cpu`: the process's CPU time) of `--trials` calls, the two paths alternating
call by call so that a shared machine's load hits both alike; the ratio is bf16's time over
head8's (above 1: head8 is faster)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np

from batchmlx.engine.host import head8
from batchmlx.engine.host.backend import current
from batchmlx.engine.host.linear import HostFormat, SharedGemm

SHAPES = {"135m": (49152, 576), "gemma3-1b": (262144, 1152), "1.7b": (49152, 2048)}


@dataclass(frozen=True)
class Row:
    shape: str
    rows: int
    head8_ms: float
    bf16_ms: float
    ratio: float  # bf16 / head8


def _median_ms(times: list[float]) -> float:
    return round(float(np.median(times)) * 1e3, 3)


def measure(shape: str, widths: list[int], trials: int, clock: str = "wall",
            use_amx: bool | None = None) -> list[Row]:  # fmt: skip
    n, k = SHAPES[shape]
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n, k), dtype=np.float32) * 0.05).astype(np.float32)
    bf16 = SharedGemm([mx.array(w)], HostFormat.BF16)
    eight = SharedGemm([mx.array(w)], HostFormat.W8)
    assert eight.fmt is HostFormat.W8, "the 8-bit head does not run here"
    del w
    backend, h8 = eight.backend, eight._h8
    assert h8 is not None

    def run8(x: np.ndarray, y: np.ndarray) -> None:  # SharedGemm.host's, its path forced
        head8.matmul(
            x, h8, y, threads=backend.threads.or_cpus(), pool=backend.pool, use_amx=use_amx
        )

    out: list[Row] = []
    now = time.perf_counter if clock == "wall" else time.process_time
    for m in widths:
        x = rng.standard_normal((m, k), dtype=np.float32)
        y = np.empty((m, n), np.float32)
        times: dict[str, list[float]] = {"head8": [], "bf16": []}
        for _ in range(trials + 2):
            for name, call in (("head8", run8), ("bf16", bf16.host)):
                t = now()
                call(x, y)
                times[name].append(now() - t)
        a, b = (_median_ms(times[p][2:]) for p in ("head8", "bf16"))
        out.append(Row(shape, m, a, b, round(b / a, 2)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="135m")
    p.add_argument("--rows", default="1,8,64")
    p.add_argument("--trials", type=int, default=30)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the process's CPU time (with BATCHMLX_THREADS=1: a loaded "
                   "machine's time slices not counted)")  # fmt: skip
    p.add_argument("--path", choices=("auto", "amx", "avx512"), default="auto",
                   help="head8's path (auto: this process's). A CPU without AMX, as oneDNN "
                   "sees it: ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 with --path avx512")  # fmt: skip
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if not head8.available():
        print("the 8-bit head kernel does not run on this CPU (AVX-512 BF16)")
        return 1
    widths = [int(w) for w in a.rows.split(",")]
    use_amx = {"auto": None, "amx": True, "avx512": False}[a.path]
    path = a.path if use_amx is not None else ("amx" if head8.amx() else "avx512")
    rows = [r for s in a.shape.split(",") for r in measure(s, widths, a.trials, a.clock, use_amx)]
    probe = SharedGemm([mx.zeros((64, 64))], HostFormat.BF16)
    kernel = current().onednn().kernel(64, probe._w)
    cpu = platform.processor() or platform.machine()
    load = os.getloadavg()[0]
    threads = current().threads.or_cpus()
    if a.json:
        print(json.dumps({"cpu": cpu, "load": load, "threads": threads, "clock": a.clock,
                          "path": path,
                          "rows": [asdict(r) for r in rows]}))  # fmt: skip
        return 0
    print(
        f"{threads} threads, load {load:.1f}, {a.clock} time, head8 through "
        f"{path}; oneDNN bf16 at 64 rows: {kernel}"
    )
    print("shape       rows   head8 ms   bf16 ms   bf16/head8")
    for r in rows:
        print(f"{r.shape:<11} {r.rows:>4} {r.head8_ms:>10.3f} {r.bf16_ms:>9.3f} {r.ratio:>11.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
