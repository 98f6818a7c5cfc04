"""The state of one `python -m benchmarks.run`: the loaded model, the workloads and every
measurement, each run at most once (sections reusing another's workload read it from here)."""

from __future__ import annotations

import sys
import time
from typing import Any

from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.engine.runners.paged import paged_engine
from benchmarks import workloads as wl
from benchmarks.common import Settings
from benchmarks.measure import RunResult, run_ours, run_peer

_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


class Bench:
    """The loaded model, the workloads and every measurement, each run at most once."""

    def __init__(
        self, s: Settings, loaded: Any, *, quick: bool = False, baseline: str | None = None
    ) -> None:
        self.s = s
        self.quick = quick
        self.baseline = baseline  # git revision measured beside this one in section 6
        self.loaded = loaded
        self.tok = loaded.tokenizer
        self._memo: dict[tuple, Any] = {}
        self.section_s: dict[int, float] = {}

    def _once(self, key: tuple, fn, *args) -> Any:
        if key not in self._memo:
            log(f"running {key} ...")
            t = time.perf_counter()
            self._memo[key] = fn(*args)
            res = self._memo[key]
            extra = f", {res.tok_s:.1f} tok/s" if isinstance(res, RunResult) else ""
            log(f"done {key} in {time.perf_counter() - t:.1f}s{extra}")
        return self._memo[key]

    # -- engine configurations -----------------------------------------------------------------
    def config(self, *, simple: bool = False, sharing: bool = True, grow: int | None = None):
        s = self.s
        return EngineSettings(
            simple=simple,
            max_batch_size=s.max_batch_size,
            block_size=s.block_size,
            use_paged_cache=sharing,
            kv_grow_blocks=grow or s.kv_grow_blocks,
        )

    # -- workloads -----------------------------------------------------------------------------
    def unique(self, n: int) -> list[list[int]]:
        return wl.unique_prompts(self.tok, n)

    def shared(self) -> list[list[int]]:
        return wl.shared_prompts(self.tok, self.s.shared_requests, self.s.shared_system_tokens)

    def memory_prompts(self) -> list[list[int]]:
        return wl.shared_prompts(self.tok, self.s.memory_requests, self.s.memory_system_tokens)

    # -- measurements --------------------------------------------------------------------------
    def warm_up(self) -> None:
        log("warm-up (ours and the peer, 2 requests x 4 tokens)")
        prompts = self.unique(2)
        run_ours(self.loaded, prompts, 4, self.config(), "warm-up")
        run_ours(self.loaded, prompts[:1], 4, self.config(simple=True), "warm-up")
        run_peer(self.loaded, prompts, 4, self.s.max_batch_size, "warm-up")

    def simple_pass(self) -> RunResult:
        """Simple mode over the largest row's prompts, one after another; row n is its first
        n requests (they finish exactly as they would with only n submitted)."""
        n = max(self.s.concurrency)
        return self._once(
            ("simple", n),
            run_ours,
            self.loaded,
            self.unique(n),
            self.s.max_tokens,
            self.config(simple=True),
            "simple",
        )

    def simple(self, n: int) -> RunResult:
        return self.simple_pass().prefix(n)

    def continuous(self, n: int) -> RunResult:
        return self._once(
            ("continuous", n),
            run_ours,
            self.loaded,
            self.unique(n),
            self.s.max_tokens,
            self.config(),
            "continuous",
        )

    def peer(self, n: int) -> RunResult:
        return self._once(
            ("batch_generate", n),
            run_peer,
            self.loaded,
            self.unique(n),
            self.s.max_tokens,
            self.s.max_batch_size,
            "batch_generate",
        )

    def shared_run(self, who: str) -> RunResult:
        s = self.s
        if who == "peer":
            args = (self.shared(), s.shared_max_tokens, s.max_batch_size, who)
            return self._once(("shared", who), run_peer, self.loaded, *args)
        cfg = self.config(sharing=who == "ours", grow=s.memory_grow_blocks)
        args = (self.shared(), s.shared_max_tokens, cfg, who)
        return self._once(("shared", who), run_ours, self.loaded, *args)

    def memory_run(self, sharing: bool) -> RunResult:
        s = self.s
        cfg = self.config(sharing=sharing, grow=s.memory_grow_blocks)
        args = (self.memory_prompts(), s.memory_max_tokens, cfg, f"sharing={sharing}")
        return self._once(("memory", sharing), run_ours, self.loaded, *args)

    def prefix_steps(self) -> list[tuple[str, str, set[str], Any]]:
        return self._once(("prefix-cache",), self._prefix_steps)

    def _prefix_steps(self) -> list[tuple[str, str, set[str], Any]]:
        a, b = self.unique(2)
        eng = paged_engine(
            self.loaded.model,
            self.tok,
            context_length=self.loaded.context_length,
            config=self.config(),
        )
        params = SamplingParams(max_tokens=self.s.prefix_max_tokens, temperature=0.0)
        plan = [
            ("1a", "First request", a, {"MISS"}),
            ("1b", "Same prompt", a, {"HIT"}),
            ("1c", "Different prompt", b, {"MISS", "PREFIX_HIT"}),
            ("1d", "Return to prompt 1", a, {"HIT"}),
        ]
        rows = []
        for step, desc, prompt, expected in plan:
            (out,) = eng.generate([GenerationRequest(f"p{step}", list(prompt), params)])
            rows.append((step, desc, expected, out))
        return rows
