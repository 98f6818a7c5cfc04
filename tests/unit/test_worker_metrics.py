"""The worker's metrics hook (worker/metrics.py): cumulative engine counters become exact
increments of the process registry, and the chart's per-second series."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest

from batchmlx.core.lifecycle import RequestStatus
from batchmlx.core.records import RequestResult
from batchmlx.core.telemetry import EngineCounters
from batchmlx.worker.metrics import REGISTRY, EngineMetrics, Series


def value(name: str, **labels: str) -> float:
    v = REGISTRY.get_sample_value(name, labels)
    assert v is not None, name
    return v


@dataclass
class FakeEngine:
    now: EngineCounters

    def counters(self) -> EngineCounters:
        return self.now


NAMES = [
    ("batchmlx_generated_tokens_total", {}),
    ("batchmlx_preemptions_total", {}),
    ("batchmlx_step_seconds_count", {}),
    ("batchmlx_step_seconds_sum", {}),
    ("batchmlx_prefix_cache_outcomes_total", {"outcome": "HIT"}),
    ("batchmlx_prefix_cache_outcomes_total", {"outcome": "PREFIX_HIT"}),
    ("batchmlx_prefix_cache_outcomes_total", {"outcome": "MISS"}),
]


def snapshot() -> list[float]:
    return [value(n, **lb) for n, lb in NAMES]


def test_steps_become_increments_and_gauges():
    series = Series(seconds=60)
    m = EngineMetrics(series)
    engine = FakeEngine(EngineCounters(steps=2, step_s=0.5, generated_tokens=10, misses=2,
                                       running=2, blocks_in_use=4, blocks_cached=3,
                                       blocks_free=11))  # fmt: skip
    before = snapshot()
    m.after_step(engine, 100.2)
    engine.now = EngineCounters(steps=3, step_s=0.75, generated_tokens=14, preemptions=1, hits=1,
                                prefix_hits=2, misses=2, running=4, blocks_in_use=6,
                                blocks_cached=5, blocks_free=9)  # fmt: skip
    m.after_step(engine, 100.7)
    after = snapshot()
    deltas = [round(a - b, 9) for a, b in zip(after, before, strict=True)]
    # 14 tokens, 1 preemption, 3 steps taking 0.75 s, outcomes HIT 1, PREFIX_HIT 2, MISS 2
    assert deltas == [14, 1, 3, 0.75, 1, 2, 2]
    assert value("batchmlx_running_batch_size") == 4
    assert [value("batchmlx_kv_blocks", state=s) for s in ("in_use", "cached", "free")] == [6, 5, 9]
    assert series.latest == engine.now
    # the first two steps took 0.5 s (99.7-100.2): 6 of their 10 tokens in second 99
    assert [(p.t, pytest.approx(p.tokens), p.running) for p in series.points] == [
        (99, 6, 0),
        (100, 8, 4),
    ]
    # a last step that empties the batch: the second still shows the batch it ran
    engine.now = replace(engine.now, steps=4, step_s=0.8, generated_tokens=18, running=0)
    m.after_step(engine, 100.9)
    assert [(p.t, p.running, p.end_running) for p in series.points] == [(99, 0, 0), (100, 4, 0)]


def test_a_new_engine_counts_from_zero():
    m = EngineMetrics(Series())
    m.after_step(FakeEngine(EngineCounters(steps=5, generated_tokens=50)), 1.0)
    before = value("batchmlx_generated_tokens_total")
    m.after_step(FakeEngine(EngineCounters(steps=1, generated_tokens=3)), 2.0)  # model switch
    assert value("batchmlx_generated_tokens_total") - before == 3


def test_an_engine_without_counters_is_ignored():
    series = Series()
    EngineMetrics(series).after_step(object(), 1.0)
    assert not series.points


def test_results_count_by_status_and_source():
    names = [
        ("batchmlx_requests_completed_total", {"source": "batch"}),
        ("batchmlx_requests_failed_total", {"source": "batch"}),
        ("batchmlx_requests_completed_total", {"source": "online"}),
        ("batchmlx_prompt_tokens_total", {}),
        ("batchmlx_cached_tokens_total", {}),
    ]
    before = [value(n, **lb) for n, lb in names]
    ok = RequestResult(RequestStatus.SUCCEEDED, 200, {}, prompt_tokens=30, cached_tokens=16)
    bad = RequestResult(RequestStatus.FAILED, 400, {}, prompt_tokens=0)
    EngineMetrics.results([ok, ok, bad])
    EngineMetrics.results([ok], "online")
    after = [value(n, **lb) for n, lb in names]
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 1, 1, 90, 48]


def test_series_fills_idle_seconds_and_leaves_out_the_current_one():
    s = Series(seconds=5)
    s.add(10.1, 5, 2)
    s.add(10.9, 7, 3)
    s.add(12.5, 4, 1)
    s.add(11.0, 99, 0)  # a second before the newest point (a clock step back) is dropped
    # no step in second 11: nothing generated, the batch size held at what the last step left
    assert s.window(13.2, seconds=4) == [
        {"t": 9, "tokens": 0, "running": 0},
        {"t": 10, "tokens": 12, "running": 3},
        {"t": 11, "tokens": 0, "running": 3},
        {"t": 12, "tokens": 4, "running": 3},  # the largest: the batch before it shrank to 1
    ]


def test_a_long_step_spreads_its_tokens_over_the_seconds_it_took():
    s = Series(seconds=10)
    s.add(20.5, 10, 4, duration=0.5)  # 20.0-20.5
    s.add(23.0, 30, 8, duration=2.5)  # 20.5-23.0: 6 in second 20, 12 in 21 and 22, 0 in 23
    assert [(p.t, p.tokens, p.running) for p in s.points] == [
        (20, 16.0, 4),
        (21, 12.0, 4),
        (22, 12.0, 4),
        (23, 0.0, 8),
    ]
    assert s.window(24.0, seconds=5) == [
        {"t": 19, "tokens": 0, "running": 0},
        {"t": 20, "tokens": 16.0, "running": 4},
        {"t": 21, "tokens": 12.0, "running": 4},
        {"t": 22, "tokens": 12.0, "running": 4},
        {"t": 23, "tokens": 0.0, "running": 8},
    ]


def test_the_window_starts_with_the_batch_size_before_it():
    s = Series(seconds=100)
    s.add(5.0, 1, 6)
    assert s.window(10.0, seconds=3) == [
        {"t": 7, "tokens": 0, "running": 6},
        {"t": 8, "tokens": 0, "running": 6},
        {"t": 9, "tokens": 0, "running": 6},
    ]


def test_series_keeps_only_its_last_seconds():
    s = Series(seconds=3)
    for t in range(10):
        s.add(float(t), t, 1)
    assert [p.t for p in s.points] == [7, 8, 9]
