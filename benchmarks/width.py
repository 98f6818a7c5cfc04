"""The running width: `python -m benchmarks.width [--quick] [--dtype float32]`.

tok/s on the unique-prompt workload (different questions, greedy, no early stop: every request
generates max_tokens) at fixed widths (`--max-batch-size` w with the adaptive width off), then
at batchmlx's defaults (adaptive width, cap 256), saying which width the engine picked by itself
and what it measured on the way. Each run is timed from all requests submitted to the last one
finished, prefill included, in one process, one after another.

`section(quick)` returns markdown lines for `benchmarks/run.py`.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from batchmlx.core.engine_api import ENGINE_DEFAULTS, EngineSettings
from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.engine.runners.paged import paged_engine
from benchmarks import workloads as wl

WIDTHS = (8, 16, 32, 64, 128, 256)
QUICK_WIDTHS = (8, 16, 32)


@dataclass(frozen=True, slots=True)
class WidthSettings:
    requests: int = 256
    max_tokens: int = 32  # 8,192 tokens a row: width 8 alone takes minutes
    widths: tuple[int, ...] = WIDTHS


QUICK = WidthSettings(requests=32, max_tokens=16, widths=QUICK_WIDTHS)


def log(msg: str) -> None:
    print(f"[width-bench] {msg}", file=sys.stderr, flush=True)


@dataclass(slots=True)
class WidthRun:
    label: str
    wall_s: float
    tokens: int
    peak_running: int
    preemptions: int
    final_limit: int | None = None  # adaptive: the limit at the end
    steps: list[str] = field(default_factory=list)  # adaptive: its changes, in words
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


def run_width(loaded: Any, prompts: list[list[int]], max_tokens: int, cfg: EngineSettings,
              label: str) -> WidthRun:  # fmt: skip
    gc.collect()
    mx.synchronize()
    mx.clear_cache()
    eng = paged_engine(
        loaded.model, loaded.tokenizer, context_length=loaded.context_length, config=cfg
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    reqs = [GenerationRequest(f"r{i}", list(p), params) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    outs = eng.generate(reqs)
    wall = time.perf_counter() - t0
    run = WidthRun(
        label=label, wall_s=wall, tokens=sum(len(o.token_ids) for o in outs),
        peak_running=eng.runner.scheduler.stats.peak_running,
        preemptions=eng.runner.scheduler.stats.preemptions,
        outputs=[list(o.token_ids) for o in outs],
    )  # fmt: skip
    if eng.runner.width is not None:
        run.final_limit = eng.runner.width.limit
        for c in eng.runner.width.changes:
            rate = f" at {c.tok_s:.0f} tok/s" if c.tok_s is not None else ""
            run.steps.append(f"{c.old} -> {c.new} ({c.reason}{rate}, step {c.step})")
    log(f"{label}: {run.tok_s:.1f} tok/s, {wall:.1f}s, peak running {run.peak_running}")
    return run


def load(model: str = "default", dtype: str = "float32") -> Any:
    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import load_model

    cache = Path(os.environ.get("BATCHMLX_CACHE_DIR", "~/.cache/batchmlx-test")).expanduser()
    spec = resolve_model(model, cache_dir=cache)
    if spec is None:
        raise SystemExit(f"cannot resolve model {model!r}")
    return load_model(spec, cache_dir=cache, dtype=dtype)


def section(quick: bool = False, loaded: Any = None, dtype: str = "float32",
            settings: WidthSettings | None = None) -> list[str]:  # fmt: skip
    s = settings or (QUICK if quick else WidthSettings())
    loaded = loaded if loaded is not None else load(dtype=dtype)
    prompts = wl.unique_prompts(loaded.tokenizer, s.requests)
    run_width(loaded, prompts[:2], 4, EngineSettings(), "warm-up")
    fixed = [
        run_width(loaded, prompts, s.max_tokens,
                  EngineSettings(max_batch_size=w, adaptive_width=False), f"width {w}")
        for w in s.widths
    ]  # fmt: skip
    auto = run_width(loaded, prompts, s.max_tokens, EngineSettings(), "adaptive")
    base = next((r for r in fixed if r.label == "width 32"), fixed[0])
    same = sum(a == b for a, b in zip(auto.outputs, base.outputs, strict=True))
    lines = [
        "## Running width",
        "",
        f"Unique prompts: {s.requests} requests of different questions "
        f"({wl.length_summary(prompts)}), {s.max_tokens} new tokens each, greedy; one engine "
        "per row, timed from all requests submitted to the last finished (prefill included). "
        f"Fixed rows: `--max-batch-size w` with the adaptive width off; the last row is the "
        f"default (adaptive, cap {ENGINE_DEFAULTS.max_batch_size}).",
        "",
        f"| width | tok/s | vs {base.label} | wall s | peak running | preemptions |",
        "|---|---|---|---|---|---|",
    ]
    for r in [*fixed, auto]:
        lines.append(
            f"| {r.label} | {r.tok_s:.1f} | {r.tok_s / base.tok_s:.2f}x | {r.wall_s:.1f} "
            f"| {r.peak_running} | {r.preemptions} |"
        )
    lines += [
        "",
        f"The adaptive engine ended at a running limit of {auto.final_limit} (peak running "
        f"{auto.peak_running}); its steps: " + ("; ".join(auto.steps) or "none") + ".",
        f"Greedy tokens identical to {base.label}: {same}/{len(auto.outputs)} requests.",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--no-fast-blas", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown here too")
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--widths", default=None, help="comma-separated fixed widths")
    args = ap.parse_args(argv)
    if not args.no_fast_blas:
        from benchmarks.common import fast_blas

        fast_blas()  # re-executes this command line once, before any timing
    s = QUICK if args.quick else WidthSettings()
    s = WidthSettings(
        requests=args.requests or s.requests, max_tokens=args.max_tokens or s.max_tokens,
        widths=tuple(int(w) for w in args.widths.split(",")) if args.widths else s.widths,
    )  # fmt: skip
    text = "\n".join(section(args.quick, dtype=args.dtype, settings=s))
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
