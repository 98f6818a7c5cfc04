"""What an engine reports once per step for metrics: its cumulative counters and current gauges.

A plain record, so the worker (and a fake engine in tests) needs no MLX to read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineCounters:
    # cumulative since the engine was built
    steps: int = 0
    step_s: float = 0.0  # wall time of whole steps
    generated_tokens: int = 0  # every sampled token, end-of-sequence tokens included
    preemptions: int = 0
    hits: int = 0  # first admissions by prefix-cache outcome
    prefix_hits: int = 0
    misses: int = 0
    # now
    running: int = 0  # sequences in the running batch
    blocks_in_use: int = 0  # KV blocks held by some sequence
    blocks_cached: int = 0  # KV blocks holding a cached prefix (in use or evictable)
    blocks_free: int = 0  # KV blocks allocate() can hand out, evictable cached ones included
