"""Timed runs of one workload: batchmlx's Engine, or mlx-lm's BatchGenerator (the peer).

Every run is measured the same way: all requests are submitted at t0, tok/s is the generated
tokens over the wall time from t0 until the last request finishes (prefill included), and no
request stops early (ours get no stop token ids; the peer gets no stop tokens), so both sides
generate exactly max_tokens per request.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.engine.runners.paged import paged_engine


@dataclass(slots=True)
class RunResult:
    label: str
    wall_s: float  # t0 (all requests submitted) to the last finish
    tokens: list[list[int]]  # generated token ids per request, in prompt order
    ttft_s: list[float]  # per request: t0 to its first token
    finish_s: list[float]  # per request: t0 to its last token
    mlx_peak_bytes: int  # mx.get_peak_memory() above the memory active before the run
    sched: dict[str, int] = field(default_factory=dict)  # ours: scheduler stats
    engine: dict[str, int] = field(default_factory=dict)  # ours: engine stats, storage_blocks
    cached_tokens: list[int] = field(default_factory=list)  # ours: prompt tokens reused

    @property
    def gen_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def tok_s(self) -> float:
        return self.gen_tokens / self.wall_s

    def prefix(self, n: int) -> RunResult:
        """The first n requests of a sequential (simple-mode) run, as if only they had run:
        requests run one after another, so the first n finish exactly as they would alone."""
        return RunResult(
            label=self.label,
            wall_s=max(self.finish_s[:n]),
            tokens=self.tokens[:n],
            ttft_s=self.ttft_s[:n],
            finish_s=self.finish_s[:n],
            mlx_peak_bytes=self.mlx_peak_bytes,
        )

    def decode_speeds(self) -> list[float]:
        """Per request: tokens after the first over the time between first and last token."""
        return [
            (len(t) - 1) / (f - a)
            for t, a, f in zip(self.tokens, self.ttft_s, self.finish_s, strict=True)
            if len(t) > 1 and f > a
        ]


def _start_memory() -> int:
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    return mx.get_active_memory()


def run_ours(
    loaded: Any, prompts: list[list[int]], max_tokens: int, config: EngineSettings, label: str
) -> RunResult:
    base = _start_memory()
    eng = paged_engine(
        loaded.model, loaded.tokenizer, context_length=loaded.context_length, config=config
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    reqs = [GenerationRequest(f"r{i}", list(p), params) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    for r in reqs:
        eng.add(r)
    outs, finish = {}, {}
    while eng.has_unfinished():
        for o in eng.step():
            finish[o.request_id] = time.perf_counter() - t0
            outs[o.request_id] = o
    wall = time.perf_counter() - t0
    peak = mx.get_peak_memory() - base
    ordered = [outs[r.request_id] for r in reqs]
    return RunResult(
        label=label,
        wall_s=wall,
        tokens=[list(o.token_ids) for o in ordered],
        # first_token_s counts from add(); every add happened within microseconds of t0
        ttft_s=[o.first_token_s or 0.0 for o in ordered],
        finish_s=[finish[r.request_id] for r in reqs],
        mlx_peak_bytes=peak,
        sched=_as_dict(eng.runner.scheduler.stats),
        engine={**eng.runner.stats.as_dict(), "storage_blocks": eng.runner.storage.capacity_blocks},
        cached_tokens=[o.cached_tokens for o in ordered],
    )


def run_peer(
    loaded: Any, prompts: list[list[int]], max_tokens: int, batch_size: int, label: str
) -> RunResult:
    """mlx_lm.batch_generate's loop with its defaults, except that eos does not stop a request
    (batch_generate hard-codes stop_tokens to eos, so BatchGenerator is built directly)."""
    from mlx_lm.generate import BatchGenerator

    base = _start_memory()
    gen = BatchGenerator(
        loaded.model, stop_tokens=[], max_tokens=max_tokens, completion_batch_size=batch_size
    )
    t0 = time.perf_counter()
    uids = gen.insert([list(p) for p in prompts], [max_tokens] * len(prompts))
    tokens: dict[int, list[int]] = {u: [] for u in uids}
    first: dict[int, float] = {}
    finish: dict[int, float] = {}
    while responses := gen.next_generated():
        now = time.perf_counter() - t0
        for r in responses:
            first.setdefault(r.uid, now)
            if r.finish_reason != "stop":
                tokens[r.uid].append(int(r.token))
            if r.finish_reason is not None:
                finish[r.uid] = now
    wall = time.perf_counter() - t0
    peak = mx.get_peak_memory() - base
    gen.close()
    return RunResult(
        label=label,
        wall_s=wall,
        tokens=[tokens[u] for u in uids],
        ttft_s=[first[u] for u in uids],
        finish_s=[finish[u] for u in uids],
        mlx_peak_bytes=peak,
    )


def agreement(a: RunResult, b: RunResult) -> float:
    """Fraction of requests whose greedy tokens are identical in both runs."""
    same = sum(x == y for x, y in zip(a.tokens, b.tokens, strict=True))
    return same / len(a.tokens)


def summary(xs: list[float]) -> tuple[float, float, float]:
    """mean, p50, max."""
    return statistics.fmean(xs), statistics.median(xs), max(xs)


def _as_dict(obj: Any) -> dict[str, int]:
    return {k: getattr(obj, k) for k in obj.__slots__}
