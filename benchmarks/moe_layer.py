"""One mixture-of-experts layer's expert GEMMs in int8, one kernel call an expert against one
call for all of a group's experts (q8.c's q8_experts), side by side:
`python -m benchmarks.moe_layer [--tokens 1,8,32,64,128] [--threads 1,2] [--trials 15]`.

The layer is qwen3_moe's at the families benchmark's size (benchmarks/families.py: hidden 576,
8 experts of 768, 2 a token), random weights, each token's experts routed from random router
logits as the host step routes them (engine/host/experts.py's `route`). Both paths are
`expert_outputs` of the same `HostExperts` (engine/host/linear.py): its GEMMs one expert at a
time (`runs` left out) or a group of experts' runs at a time (what int8 runs). Each trial runs
the paths in turn (a shared machine's load hits both alike); the median of the trials, at one
thread in this thread's CPU time (time another process holds the core is not counted), at two in
wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from benchmarks.int8_kernel import machine

HIDDEN, INNER, EXPERTS, TOP_K = 576, 768, 8, 2
MIN_RUN_S = 0.005  # a timed run repeats a call to last at least this long


def _per_call(fn: Callable[[], object], repeats: int, clock: Callable[[], float]) -> float:
    t = clock()
    for _ in range(repeats):
        fn()
    return (clock() - t) / repeats


def medians(paths: dict[str, Callable[[], object]], trials: int,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:  # fmt: skip
    """Seconds per call of each path: the median of `trials`, the paths in turn in each."""
    repeats = {name: max(1, int(MIN_RUN_S / max(_per_call(fn, 1, time.perf_counter), 1e-7)))
               for name, fn in paths.items()}  # fmt: skip
    runs: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(trials):
        for name, fn in paths.items():
            runs[name].append(_per_call(fn, repeats[name], clock))
    return {name: statistics.median(v) for name, v in runs.items()}


def main(argv: list[str] | None = None) -> int:
    from mlx_lm.models.switch_layers import SwitchGLU

    from batchmlx.engine.host import experts as host_experts
    from batchmlx.engine.host.backend import current
    from batchmlx.engine.host.elementwise import swiglu_halves
    from batchmlx.engine.host.linear import HostExperts, HostFormat

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1,8,32,64,128")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--trials", type=int, default=15)
    a = p.parse_args(argv)
    mx.random.seed(0)
    be = current()
    glu = SwitchGLU(HIDDEN, INNER, EXPERTS)
    host = HostExperts(glu, HostFormat.INT8, None, "mlp.switch_mlp", be)
    grouped = host.gemms()
    if grouped.runs is None:
        raise SystemExit("the grouped int8 kernel does not run here (see the log)")
    alone = dataclasses.replace(grouped, runs=None)
    rng = np.random.default_rng(0)
    print(f"{machine()} (start)\n")
    print("| tokens | threads | per expert ms | one call ms | per expert / one call |")
    print("|---|---|---|---|---|")
    for threads in (int(v) for v in a.threads.split(",")):
        be.threads.n = threads
        for t in (int(v) for v in a.tokens.split(",")):
            x = rng.standard_normal((t, HIDDEN)).astype(np.float32)
            logits = rng.standard_normal((t, EXPERTS)).astype(np.float32)
            chosen = host_experts.route(logits, TOP_K, True).experts

            def act(h: np.ndarray) -> np.ndarray:
                return swiglu_halves(h, backend=be)

            paths = {name: (lambda g=g, x=x, c=chosen: host_experts.expert_outputs(x, c, g, act))
                     for name, g in (("alone", alone), ("grouped", grouped))}  # fmt: skip
            got = {name: fn() for name, fn in paths.items()}
            assert np.array_equal(got["alone"], got["grouped"])  # the same bits
            clock = time.thread_time if threads == 1 else time.perf_counter
            ms = {name: 1e3 * s for name, s in medians(paths, a.trials, clock).items()}
            ratio = ms["alone"] / ms["grouped"]
            print(f"| {t} | {threads} | {ms['alone']:.3f} | {ms['grouped']:.3f} | {ratio:.2f}x |",
                  flush=True)  # fmt: skip
    print(f"\n{machine()} (end)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
