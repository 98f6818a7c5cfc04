"""Where a batchmlx step's time goes, for `benchmarks.profile_steps`: the two profiling passes,
each run apart from the timing passes (their own overhead stays out of the step figures).

- `Barriers`: every piece of the step wrapped, from outside, with a timer and an `mx.eval`
  barrier on its inputs and outputs (what was pending when a piece starts is filed as "other
  model ops"): the model's Linear calls split into attention projections (q, k, v, o), MLP
  (gate, up, down) and the vocabulary head; attention (MLX tiles or the host kernels, with the
  host kernels' hand-off, evaluation and copies, timed inside it); KV writes and gathers; RMS
  norms; RoPE; SwiGLU; the step's layout and decode-KV plan; sampling; post-processing
  (core/postprocess.py); scheduling (core/scheduler.py schedule + update). The rest of the
  step is Python glue (the engine step, the forward's graph building outside those pieces).
- `Profiled`: cProfile over the main thread's steps, its functions filed by what they are: MLX
  evaluation (`mx.eval`, wrapped in a Python function for the pass: cProfile does not see
  nanobind's C functions, so every other MLX call, the graph building, is counted in the Python
  function that makes it), numpy (conversions from MLX, which evaluate, the host kernels and the
  waits for their threads), and Python by package.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from benchmarks.prefill_mfu import _arrays

PROJ = "matmuls: attention projections (q, k, v, o)"
MLP = "matmuls: MLP (gate, up, down)"
HEAD = "matmuls: lm_head (vocabulary)"
ATTN = "attention (scores, softmax, values)"
HANDOFF = "  of which host hand-off (eval, numpy views, copy back)"
KV = "KV writes and gathers (update_and_fetch)"
NORM = "RMS norms"
ROPE = "RoPE"
SWIGLU = "SwiGLU"
OTHER = "other model ops (embedding, residuals, reshapes)"
LAYOUT = "layout and decode-KV plan"
SAMPLE = "sampling (argmax, to host)"
POST = "post-processing (core/postprocess.py)"
SCHED = "scheduling (core/scheduler.py)"
GLUE = "Python glue (engine step, graph building)"
BUCKETS = (PROJ, MLP, HEAD, ATTN, HANDOFF, KV, NORM, ROPE, SWIGLU, OTHER, LAYOUT, SAMPLE, POST,
           SCHED, GLUE)  # fmt: skip
INNER = (HANDOFF,)  # timed inside another bucket: not added to the step's sum


class Barriers:
    """Timers around each piece of an engine's step, installed by `installed(engine)`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.depth = 0
        self.host_depth = 0

    def timed(self, bucket: str | Callable[[Any], str], fn: Callable, barrier: bool = True,
              method: bool = False) -> Callable:  # fmt: skip
        import mlx.core as mx

        def wrapper(*args, **kw):
            if self.depth:
                return fn(*args, **kw)
            name = bucket(args[0]) if callable(bucket) else bucket
            t0 = time.perf_counter()
            if barrier:
                mx.eval(_arrays([args, kw]))
            t1 = time.perf_counter()
            self.depth += 1
            try:
                out = fn(*args, **kw)
                if barrier:
                    mx.eval(_arrays(out))
            finally:
                self.depth -= 1
            self.seconds[OTHER] += t1 - t0
            self.seconds[name] += time.perf_counter() - t1
            return out

        return wrapper

    def inner(self, bucket: str, fn: Callable) -> Callable:
        """A timer inside a timed piece (no barrier): the host kernels' whole call."""

        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds[bucket] += time.perf_counter() - t0

        return wrapper

    @contextmanager
    def installed(self, engine: Any) -> Iterator[None]:
        import mlx.nn as nn

        from batchmlx.core import postprocess
        from batchmlx.engine.host import attention as host_attention
        from batchmlx.engine.kernels import attention, elementwise
        from batchmlx.engine.kv import decode, paged
        from batchmlx.engine.runners import paged as llm_engine

        names = {id(m): n for n, m in engine.runner.forward_pass.model.named_modules()}

        def linear(m: Any) -> str:
            n = names.get(id(m), "")
            return PROJ if n.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "o_proj") else (
                HEAD if "lm_head" in n else MLP)  # fmt: skip

        patches: list[tuple[Any, str, Any]] = []

        def patch(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
            old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            patches.append((owner, name, old))
            fn = old.__func__ if isinstance(old, staticmethod | classmethod) else old
            new = make(fn)
            if isinstance(old, staticmethod):
                new = staticmethod(new)
            elif isinstance(old, classmethod):
                new = classmethod(new)
            setattr(owner, name, new)

        t = self.timed
        patch(nn.Linear, "__call__", lambda f: t(linear, f))
        patch(nn.RMSNorm, "__call__", lambda f: t(NORM, f))
        patch(elementwise.StepRoPE, "__call__", lambda f: t(ROPE, f))
        patch(engine.runner.forward_pass, "head", lambda f: t(HEAD, f))
        patch(engine.runner.forward_pass.attention, "paged", lambda f: t(ATTN, f))
        patch(attention, "step_swiglu", lambda f: t(SWIGLU, f))
        patch(attention, "host_attention", lambda f: self.inner(HANDOFF, f))
        patch(attention, "host_cascade_attention", lambda f: self.inner(HANDOFF, f))
        # the numpy work inside the host kernels, taken back out of the hand-off
        patch(host_attention, "_attend", lambda f: self._minus(HANDOFF, f))
        patch(paged.PagedLayerCache, "update_and_fetch", lambda f: t(KV, f))
        patch(paged.BatchLayout, "build", lambda f: t(LAYOUT, f))
        patch(paged.PackedLayout, "build", lambda f: t(LAYOUT, f))
        patch(decode.DecodeKV, "attach", lambda f: t(LAYOUT, f))
        patch(llm_engine, "sample", lambda f: t(SAMPLE, f))
        patch(postprocess.Postprocessor, "__call__", lambda f: t(POST, f, barrier=False))
        patch(engine.runner.scheduler, "schedule", lambda f: t(SCHED, f, barrier=False))
        patch(engine.runner.scheduler, "update", lambda f: t(SCHED, f, barrier=False))
        try:
            yield
        finally:
            for owner, name, old in reversed(patches):
                setattr(owner, name, old)

    def _minus(self, bucket: str, fn: Callable) -> Callable:
        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds[bucket] -= time.perf_counter() - t0

        return wrapper

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)


def per_step(before: dict[str, float], after: dict[str, float], step_s: float) -> dict[str, float]:
    """One step's seconds by bucket (the glue: what no bucket holds)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in BUCKETS if k != GLUE}
    d[GLUE] = max(0.0, step_s - sum(v for k, v in d.items() if k not in INNER))
    return d


# -- cProfile ------------------------------------------------------------------------------------

EVAL = "MLX evaluation (mx.eval)"
HOST = "numpy: conversions from MLX (they evaluate), host kernels, waits for their threads"
PY_SCHED = "Python: scheduling, blocks (core/)"
PY_POST = "Python: post-processing, finish rules (core/)"
PY_ENGINE = "Python + MLX op calls: engine, runner, KV layout, kernels (engine/)"
PY_MODEL = "Python + MLX op calls: model code (mlx_lm, mlx.nn)"
PY_OTHER = "Python: other"
PROFILE_BUCKETS = (EVAL, HOST, PY_SCHED, PY_POST, PY_ENGINE, PY_MODEL, PY_OTHER)


def _mlx_eval(*args: Any, **kw: Any) -> Any:  # mx.eval, seen by cProfile (see the module note)
    return _REAL_EVAL[0](*args, **kw)


_REAL_EVAL: list[Any] = []


class Profiled:
    """One cProfile.Profile per step class, enabled around the steps of that class only."""

    def __init__(self) -> None:
        self.profiles: dict[str, cProfile.Profile] = {}
        self.steps: dict[str, int] = defaultdict(int)
        self.wall: dict[str, float] = defaultdict(float)

    @contextmanager
    def step(self, kind: str) -> Iterator[None]:
        import mlx.core as mx

        prof = self.profiles.setdefault(kind, cProfile.Profile())
        _REAL_EVAL[:] = [mx.eval]
        mx.eval = _mlx_eval
        t0 = time.perf_counter()
        prof.enable()
        try:
            yield
        finally:
            prof.disable()
            mx.eval = _REAL_EVAL[0]
            self.wall[kind] += time.perf_counter() - t0
            self.steps[kind] += 1

    def classified(self, kind: str) -> dict[str, float]:
        """Seconds per step of that class, by PROFILE_BUCKETS (main thread, tottime)."""
        out: dict[str, float] = defaultdict(float)
        prof = self.profiles.get(kind)
        if prof is None:
            return {}
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        for (path, _, name), (_, _, tottime, _, _) in stats.items():
            out[_bucket(path, name)] += tottime
        n = max(1, self.steps[kind])
        return {k: v / n for k, v in out.items()}


def _bucket(path: str, name: str) -> str:
    if name == "_mlx_eval":
        return EVAL
    if path == "~":  # a C function: cProfile names it "<built-in method x>" / "<method 'y' ...>"
        if "numpy" in name or "_thread.lock" in name or "acquire" in name:
            return HOST
        return PY_OTHER
    if "host_attention" in path or "host_elementwise" in path:
        return HOST
    if "/batchmlx/core/" in path:
        return PY_POST if ("postprocess" in path or "finish" in path) else PY_SCHED
    if "/batchmlx/engine/" in path:
        return PY_ENGINE
    if "mlx_lm" in path or "/mlx/" in path:
        return PY_MODEL
    return PY_OTHER
