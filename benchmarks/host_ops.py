"""The host step's elementwise kernel (engine/host/ops.py) against the numpy forms it replaces,
side by side: `python -m benchmarks.host_ops [--widths 1,64] [--steps] [--dtype int8]`.

Per pass, at each width (rows), SmolLM2-135M's shapes: the gated MLP's activation (1,536 of a
3,072-wide gate-up row), the RMSNorm with its residual add (576), RoPE of 9 query and 3 KV heads
of 64 with the queries' scale. Both forms are timed in turn within each trial (a shared
machine's load hits them alike), the best of the trials, in this thread's CPU time.

`--steps`: whole decode steps of the default model at each width, the kernel on and off in
alternate steps of one engine (the same sequences, the same load), medians of each.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import numpy as np

from batchmlx.engine.host import elementwise, ops
from batchmlx.engine.host.rope import HostRope
from batchmlx.engine.host.step import HostNorm, _rms_norm

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 576, 1536, 9, 3, 64
TRIALS = 7
MIN_RUN_S = 0.005


def _time(fn: Callable[[], object]) -> float:
    """This thread's CPU seconds a call, over a run of at least MIN_RUN_S."""
    n, t0 = 0, time.thread_time()
    while (spent := time.thread_time() - t0) < MIN_RUN_S:
        fn()
        n += 1
    return spent / n


def _passes(m: int) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """Each pass as (kernel, numpy) closures over random rows of width m."""
    rng = np.random.default_rng(0)
    gu = rng.standard_normal((m, 2 * INTER)).astype(np.float32)
    x = rng.standard_normal((m, HIDDEN)).astype(np.float32)
    r = rng.standard_normal((m, HIDDEN)).astype(np.float32)
    w = rng.standard_normal(HIDDEN).astype(np.float32)
    norm = HostNorm(w, np.float32(1e-5), w.ctypes.data)
    heads = HEADS + KV_HEADS
    qkv = rng.standard_normal((m, (heads + KV_HEADS) * HEAD_DIM)).astype(np.float32)
    rope = HostRope(HEAD_DIM, False, 10000.0, 1.0, HEAD_DIM, heads)
    positions = np.arange(100, 100 + m)
    rows = qkv[:, : heads * HEAD_DIM]
    scale = np.float32(0.125)

    def tables(native: bool):
        real = ops.available
        ops.available = lambda: native  # type: ignore[method-assign]
        try:
            return rope.tables(positions)
        finally:
            ops.available = real  # type: ignore[method-assign]

    kt, nt = tables(True), tables(False)

    def gated_numpy() -> None:
        out = np.empty((m, INTER), np.float32)
        elementwise._gated_rows(gu, out, INTER, 0, m, max(1, elementwise.TILE // INTER),
                                elementwise._swiglu_tile)  # fmt: skip

    def norm_numpy() -> None:
        y = x.copy()
        y += r
        _rms_norm(y, norm.weight, norm.eps)

    return {
        "SwiGLU": (lambda: elementwise.swiglu_halves(gu), gated_numpy),
        "residual + RMSNorm": (lambda: norm.add_then(x.copy(), r), norm_numpy),
        "RoPE + q scale": (lambda: rope.rotate_scaled(rows, kt, HEADS, scale),
                           lambda: rope.rotate_scaled(rows, nt, HEADS, scale)),
    }  # fmt: skip


def passes(widths: list[int]) -> None:
    print("| pass | rows | kernel us | numpy us | numpy / kernel |")
    print("|---|---|---|---|---|")
    for m in widths:
        for name, (kernel, numpy_form) in _passes(m).items():
            best = [float("inf"), float("inf")]
            for _ in range(TRIALS):
                for i, fn in enumerate((kernel, numpy_form)):
                    best[i] = min(best[i], _time(fn))
            k, n = (b * 1e6 for b in best)
            print(f"| {name} | {m} | {k:.1f} | {n:.1f} | {n / k:.2f}x |")


def steps(widths: list[int], dtype: str, tokens: int) -> None:
    from batchmlx.core.engine_api import ENGINE_DEFAULTS
    from batchmlx.core.request import GenerationRequest, SamplingParams
    from batchmlx.worker.build import build_engine
    from benchmarks.whole_process import CACHE

    real = ops.available()
    engine = build_engine("default", cache_dir=CACHE, dtype=dtype, settings=ENGINE_DEFAULTS).engine
    print("\n| width | decode step, kernel ms | numpy ms | numpy / kernel | steps |")
    print("|---|---|---|---|---|")
    for w in widths:
        for i in range(w):
            chat = [{"role": "user", "content": f"Tell me a long story number {i}."}]
            ids = engine.tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                       tokenize=True)  # fmt: skip
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            params = SamplingParams(max_tokens=tokens, temperature=0.0)
            engine.add(GenerationRequest(f"w{w}-{i}", ids, params))
        times: dict[bool, list[float]] = {True: [], False: []}
        n = 0
        while engine.has_unfinished():
            on = n % 2 == 0
            ops.available = (lambda: real) if on else (lambda: False)  # type: ignore[method-assign]
            t0 = time.perf_counter()
            list(engine.step())
            times[on].append(time.perf_counter() - t0)
            n += 1
        ops.available = lambda: real  # type: ignore[method-assign]
        k, m = (float(np.median(times[on][2:])) * 1e3 for on in (True, False))
        print(f"| {w} | {k:.2f} | {m:.2f} | {m / k:.3f}x | {n} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", default="1,64")
    p.add_argument("--steps", action="store_true", help="whole decode steps too")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tokens", type=int, default=128)
    a = p.parse_args()
    if not ops.available():
        raise SystemExit("the host ops kernel does not run here (AVX-512F)")
    widths = [int(w) for w in a.widths.split(",")]
    load = os.getloadavg()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, load "
          f"{load[0]:.2f} / {load[1]:.2f}")  # fmt: skip
    passes(widths)
    if a.steps:
        steps(widths, a.dtype, a.tokens)


if __name__ == "__main__":
    main()
