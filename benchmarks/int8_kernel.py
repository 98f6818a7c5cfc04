"""The grouped int8 kernel (engine/host/q8.py) against oneDNN bf16, side by side, per layer:
`python -m benchmarks.int8_kernel [--model 135m,1.7b] [--rows 1,8,...] [--threads 1,2] [--json]`.

One transformer layer's GEMMs at each width M (rows): qkv, o, gate+up and down of SmolLM2-135M
(hidden 576, intermediate 1,536, 3 KV heads) and of the 1.7B shape (hidden 2,048, intermediate
8,192, 32 KV heads), random weights. Each path is what a host layer runs for `--dtype int8` and
`--dtype bfloat16` (`HostLinear.host`): int8 quantizes its float32 input in the kernel, bf16
converts it (`to_bf16`) and runs oneDNN's matmul (its canonical-rows padding included). Columns:

- `int8`: the kernel as dispatched (AMX from `q8.AMX_ROWS` rows where `q8.amx()` holds, else VNNI);
- `int8 vnni`: its VNNI path forced (what a CPU without AMX, an AMD Zen 4, runs);
- `bf16`: oneDNN, with the kernel it picked (`brg:avx512_core_amx` where it uses AMX).

Timings: the best of `--trials` runs, the paths taken in turn within each trial (a shared
machine's load hits them alike); at 1 thread in this thread's CPU time (`time.thread_time`:
time another process holds the core is not counted), at 2 in wall time. To see bf16 as a CPU
without AMX runs it, cap oneDNN's ISA (oneDNN reads it):
`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 python -m benchmarks.int8_kernel`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from batchmlx.engine.host import q8
from batchmlx.engine.host.backend import current
from batchmlx.engine.host.onednn import DataType

# (name, N, K) per layer, the engine's fused projections
SHAPES = {
    "135m": (("qkv", 960, 576), ("o", 576, 576), ("gate+up", 3072, 576), ("down", 576, 1536)),
    "1.7b": (
        ("qkv", 6144, 2048), ("o", 2048, 2048), ("gate+up", 16384, 2048), ("down", 2048, 8192),
    ),
}  # fmt: skip
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_RUN_S = 0.005  # a timed run repeats a short call to last at least this long


@dataclass(frozen=True)
class Row:
    model: str
    rows: int
    threads: int
    int8_ms: float
    vnni_ms: float
    bf16_ms: float
    bf16_kernel: str

    @property
    def ratio(self) -> float:
        """bf16's time over int8's: above 1, int8 is faster."""
        return self.bf16_ms / self.int8_ms


def _timed(fn: Callable[[], None], repeats: int, clock: Callable[[], float]) -> float:
    t = clock()
    for _ in range(repeats):
        fn()
    return (clock() - t) / repeats


def best_of(paths: dict[str, Callable[[], None]], trials: int,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:  # fmt: skip
    """Seconds per call of each path: the best of `trials`, the paths in turn in each."""
    repeats = {}
    for name, fn in paths.items():
        fn()
        once = _timed(fn, 1, time.perf_counter)
        repeats[name] = max(1, int(MIN_RUN_S / max(once, 1e-7)))
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(trials):
        for name, fn in paths.items():
            best[name] = min(best[name], _timed(fn, repeats[name], clock))
    return best


def measure(model: str, rows: tuple[int, ...], threads: tuple[int, ...], trials: int) -> list[Row]:
    be = current()
    dnn = be.onednn()
    rng = np.random.default_rng(0)
    layers = []
    for _, n, k in SHAPES[model]:
        w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
        bf = dnn.pack(np.ascontiguousarray(dnn.to_bf16(w)), DataType.BF16, scaled=False)
        layers.append((q8.Q8Weights.pack(w), bf, k, n))
        del w
    out: list[Row] = []
    for t in threads:
        be.threads.n = t
        for m in rows:
            calls: dict[str, list[Callable[[], None]]] = {"int8": [], "vnni": [], "bf16": []}
            for qw, bf, k, n in layers:
                x = rng.standard_normal((m, k)).astype(np.float32)
                y = np.empty((m, n), np.float32)

                def int8(x=x, qw=qw, y=y, t=t, amx=None):
                    q8.matmul(x, qw, y, threads=t, use_amx=amx)

                def bf16(x=x, bf=bf, y=y):
                    dnn.matmul(dnn.to_bf16(x), bf, y)

                calls["int8"].append(int8)
                calls["vnni"].append(lambda f=int8: f(amx=False))
                calls["bf16"].append(bf16)
            paths = {name: (lambda fs=fs: [f() for f in fs] and None) for name, fs in calls.items()}
            best = best_of(paths, trials, time.thread_time if t == 1 else time.perf_counter)
            kernel = dnn.kernel(m, layers[0][1])
            out.append(Row(model, m, t, *(1e3 * best[p] for p in ("int8", "vnni", "bf16")), kernel))
            print(_line(out[-1]) if not _JSON else json.dumps({**asdict(out[-1])}), flush=True)
    return out


def machine() -> str:
    name = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    return f"{name}, {os.cpu_count()} CPUs, int8 AMX path: {q8.amx()}, load {load}"


_JSON = False
HEADER = "| model | M | threads | int8 ms | int8 vnni ms | bf16 ms | bf16 / int8 | bf16 kernel |"


def _line(r: Row) -> str:
    return (
        f"| {r.model} | {r.rows} | {r.threads} | {r.int8_ms:.3f} | {r.vnni_ms:.3f} | "
        f"{r.bf16_ms:.3f} | {r.ratio:.2f}x | {r.bf16_kernel} |"
    )


def main(argv: list[str] | None = None) -> int:
    global _JSON
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="135m,1.7b", help="comma-separated: " + ",".join(SHAPES))
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--threads", default="1,2")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--json", action="store_true", help="JSON lines only")
    a = p.parse_args(argv)
    _JSON = a.json
    if not q8.available():
        raise SystemExit("the grouped int8 kernel does not run here (see the log)")
    rows = tuple(int(v) for v in a.rows.split(","))
    threads = tuple(int(v) for v in a.threads.split(","))
    if not _JSON:
        print(f"{machine()} (start)\n\n{HEADER}\n|---|---|---|---|---|---|---|---|")
    for model in a.model.split(","):
        measure(model, rows, threads, a.trials)
    if not _JSON:
        print(f"\n{machine()} (end)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
