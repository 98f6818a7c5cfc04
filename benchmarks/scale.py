"""Scale with the work, engine side: `python -m benchmarks.scale [--quick]`.

- **KV blocks allocated vs peak in use** on the shared-system-prompt workload of
  `benchmarks.run` section 3 (the same prompts, max_tokens and kv_grow_blocks). Every request
  generates exactly max_tokens, so the block figures depend on the scheduler and the pool only,
  not on the weights: the tiny random-weight model gives the real model's block counts.
- **10,000 short requests** through one engine (tiny random-weight llama with the default
  model's tokenizer, unique prompts, max_tokens 4-8), fed as a worker feeds it (a bounded
  backlog, topped up as requests finish): wall time, and RSS plus MLX active memory sampled
  every `sample_every` finished requests; memory should stay flat after warm-up. Then the same
  number as one batch file through the worker with the real SQLite store.

`section(quick)` returns markdown lines for `benchmarks/run.py`.
"""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx

from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.request import GenerationRequest, SamplingParams
from batchmlx.engine.core import EngineCore
from batchmlx.engine.runners.paged import paged_engine
from benchmarks import workloads as wl

REPO = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[scale-bench] {msg}", file=sys.stderr, flush=True)


@cache
def tiny_loaded() -> Any:
    """The tiny random-weight llama (tests/tiny_model.py) loaded like any model folder."""
    sys.path.insert(0, str(REPO))
    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import load_model
    from tests.e2e.helpers import model_cache_dir
    from tests.tiny_model import build_tiny_model

    cache_dir = model_cache_dir()
    folder = build_tiny_model(Path(tempfile.mkdtemp(prefix="bmx-scale-")) / "tiny", cache_dir)
    spec = resolve_model(str(folder), cache_dir=cache_dir)
    return load_model(spec, cache_dir=cache_dir)


def rss_bytes() -> int:
    """Resident set size now (Linux /proc; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _mib(n: float) -> str:
    return f"{n / (1 << 20):.1f}"


# -- blocks allocated vs peak in use -----------------------------------------------------------


@dataclass(slots=True)
class BlocksResult:
    requests: int
    system_tokens: int
    max_tokens: int
    allocated: int  # blocks the KV storage backs at the end (its high-water mark)
    peak_in_use: int
    evictions: int
    prefill_reused: int
    wall_s: float


def blocks_run(n: int, system_tokens: int, max_tokens: int, grow: int = 8) -> BlocksResult:
    loaded = tiny_loaded()
    prompts = wl.shared_prompts(loaded.tokenizer, n, system_tokens)
    eng = paged_engine(
        loaded.model, loaded.tokenizer, context_length=loaded.context_length,
        config=EngineSettings(max_batch_size=32, adaptive_width=False, kv_grow_blocks=grow),
    )  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    t0 = time.perf_counter()
    eng.generate([GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)])
    return BlocksResult(
        requests=n, system_tokens=system_tokens, max_tokens=max_tokens,
        allocated=eng.runner.storage.capacity_blocks,
        peak_in_use=eng.runner.scheduler.stats.peak_blocks_in_use,
        evictions=eng.runner.pool.evictions,
        prefill_reused=eng.runner.scheduler.stats.prefill_tokens_reused,
        wall_s=time.perf_counter() - t0,
    )  # fmt: skip


# -- many short requests -----------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    done: int
    elapsed_s: float
    rss: int
    mlx_active: int
    live: int  # engine bookkeeping entries (_live + scheduler sequences + waiting)
    cached_blocks: int


@dataclass(slots=True)
class ScaleResult:
    requests: int
    wall_s: float
    tokens: int
    samples: list[Sample] = field(default_factory=list)
    peak_rss: int = 0
    mlx_peak: int = 0
    leftover: dict[str, int] = field(default_factory=dict)


def _bookkeeping(eng: EngineCore) -> int:
    sched = eng.runner.scheduler
    return len(eng._live) + len(sched._seqs) + len(sched.waiting)


def scale_run(n: int, *, backlog: int = 512, sample_every: int = 500, width: int | None = None
              ) -> ScaleResult:  # fmt: skip
    loaded = tiny_loaded()
    tok = loaded.tokenizer
    cfg = EngineSettings() if width is None else EngineSettings(max_batch_size=width)
    eng = paged_engine(loaded.model, tok, context_length=loaded.context_length, config=cfg)
    distinct = [wl.chat_prompt(tok, wl.question(i)) for i in range(len(wl.QUESTIONS))]
    gc.collect()
    mx.reset_peak_memory()
    res = ScaleResult(requests=n, wall_s=0.0, tokens=0)
    added = done = 0
    next_sample = 0
    t0 = time.perf_counter()

    def sample() -> None:
        res.samples.append(Sample(
            done, time.perf_counter() - t0, rss_bytes(), mx.get_active_memory(),
            _bookkeeping(eng), eng.runner.pool.num_cached,
        ))  # fmt: skip

    while done < n:
        while added < n and added - done < backlog:
            # unique prompts: a numbered suffix after a cycled question, 4-8 new tokens
            prompt = [*distinct[added % len(distinct)], *tok.encode(f" #{added}")]
            params = SamplingParams(max_tokens=4 + added % 5, temperature=0.0)
            eng.add(GenerationRequest(f"r{added}", prompt, params))
            added += 1
        for out in eng.step():
            res.tokens += len(out.token_ids)
            done += 1
        if done >= next_sample:
            sample()
            next_sample += sample_every
    res.wall_s = time.perf_counter() - t0
    sample()
    res.peak_rss = max(s.rss for s in res.samples)
    res.mlx_peak = mx.get_peak_memory()
    sched = eng.runner.scheduler
    res.leftover = {
        "engine _live": len(eng._live), "scheduler sequences": len(sched._seqs),
        "waiting": len(sched.waiting), "running": len(sched.running),
        "cached blocks": eng.runner.pool.num_cached, "pool blocks": eng.runner.pool.num_usable,
    }  # fmt: skip
    return res


# -- through the worker -----------------------------------------------------------------------


@dataclass(slots=True)
class WorkerSample:
    elapsed_s: float
    completed: int
    rss: int
    mlx_active: int
    pending: int  # the worker's requests in the engine
    engine_entries: int


@dataclass(slots=True)
class WorkerScaleResult:
    requests: int
    intake_s: float
    wall_s: float
    status: str
    completed: int
    samples: list[WorkerSample] = field(default_factory=list)


async def _worker_scale(n: int, every_s: float) -> WorkerScaleResult:
    import asyncio
    import json as jsonlib

    from batchmlx import batches
    from batchmlx.config import load_settings
    from batchmlx.store import Store
    from batchmlx.worker import Worker, WorkerOptions
    from tests.e2e.helpers import model_cache_dir

    loaded = tiny_loaded()
    folder = str(loaded.path)
    lines = [
        jsonlib.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": folder, "max_tokens": 4 + i % 5, "temperature": 0,
                                "messages": [{"role": "user",
                                              "content": f"{wl.question(i)} #{i}"}]}})
        for i in range(n)
    ]  # fmt: skip
    data = ("\n".join(lines) + "\n").encode()
    home = tempfile.mkdtemp(prefix="bmx-scale-home-")
    settings = load_settings({"BATCHMLX_HOME": home, "BATCHMLX_CACHE_DIR": str(model_cache_dir())})
    store = await Store.open(settings.db_path)
    try:
        worker = Worker(store, settings, WorkerOptions(until_idle=True))
        worker.load(folder)
        t = time.perf_counter()
        rec = await batches.intake.submit(store, settings, data, filename="scale.jsonl",
                                          now=time.time(), model=folder)  # fmt: skip
        intake_s = time.perf_counter() - t
        res = WorkerScaleResult(n, intake_s, 0.0, "", 0)
        t0 = time.perf_counter()

        async def sampler() -> None:
            while True:
                r = await store.get_batch(rec.id)
                eng = worker.loaded.engine if worker.loaded else None
                res.samples.append(WorkerSample(
                    time.perf_counter() - t0, r.request_counts.completed, rss_bytes(),
                    mx.get_active_memory(), len(worker.pending),
                    _bookkeeping(eng) if eng is not None else 0,
                ))  # fmt: skip
                await asyncio.sleep(every_s)

        task = asyncio.create_task(sampler())
        await worker.run()
        res.wall_s = time.perf_counter() - t0
        task.cancel()
        rec = await store.get_batch(rec.id)
        res.status, res.completed = rec.status.value, rec.request_counts.completed
        res.samples.append(WorkerSample(
            res.wall_s, res.completed, rss_bytes(), mx.get_active_memory(), len(worker.pending),
            _bookkeeping(worker.loaded.engine),
        ))  # fmt: skip
        return res
    finally:
        await store.close()


def worker_scale_run(n: int, every_s: float = 5.0) -> WorkerScaleResult:
    import asyncio

    return asyncio.run(_worker_scale(n, every_s))


# -- report ------------------------------------------------------------------------------------


def section(quick: bool = False, with_worker: bool = True) -> list[str]:
    """Markdown: blocks allocated vs peak in use, then the many-requests runs."""
    from benchmarks.common import QUICK, Settings

    s = QUICK if quick else Settings()
    log("blocks: shared-prompt workload")
    b = blocks_run(s.shared_requests, s.shared_system_tokens, s.shared_max_tokens,
                   s.memory_grow_blocks)  # fmt: skip
    n = 1000 if quick else 10_000
    log(f"scale: {n} short requests")
    r = scale_run(n, sample_every=max(100, n // 20))
    first, last = r.samples[min(1, len(r.samples) - 1)], r.samples[-1]
    lines = [
        "## Scale with the work (engine)",
        "",
        f"KV blocks on the shared-prompt workload (section 3's: {b.requests} requests behind a "
        f"~{b.system_tokens}-token system prompt, {b.max_tokens} new tokens each, "
        f"kv_grow_blocks={s.memory_grow_blocks}, width 32; block counts do not depend on the "
        "weights, so the tiny model is used): the pool reuses free and cached blocks the "
        "storage already backs before the storage grows.",
        "",
        "| blocks allocated (storage) | peak in use | cached blocks evicted "
        "| prompt tokens reused |",
        "|---|---|---|---|",
        f"| {b.allocated} | {b.peak_in_use} | {b.evictions} | {b.prefill_reused} |",
        "",
        f"{r.requests:,} short requests (tiny random-weight llama, unique prompts, 4-8 new "
        f"tokens, a backlog of 512 topped up as requests finish, adaptive width): "
        f"{r.wall_s:.1f} s, {r.requests / r.wall_s:.0f} requests/s, {r.tokens:,} tokens; "
        f"peak RSS {_mib(r.peak_rss)} MiB, MLX peak {_mib(r.mlx_peak)} MiB. Memory after warm-up "
        f"(at {first.done:,} done) vs the end: RSS {_mib(first.rss)} -> {_mib(last.rss)} MiB, "
        f"MLX active {_mib(first.mlx_active)} -> {_mib(last.mlx_active)} MiB.",
        "",
        "| requests done | elapsed s | RSS MiB | MLX active MiB | engine entries | cached blocks |",
        "|---|---|---|---|---|---|",
        *(
            f"| {x.done:,} | {x.elapsed_s:.1f} | {_mib(x.rss)} | {_mib(x.mlx_active)} | {x.live} "
            f"| {x.cached_blocks} |"
            for x in r.samples
        ),
        "",
        "Left in the engine after the run: "
        + ", ".join(f"{k} {v}" for k, v in r.leftover.items())
        + ".",
        "",
    ]
    if with_worker:
        log(f"worker: {n} short requests through SQLite")
        w = worker_scale_run(n, every_s=2.0 if quick else 10.0)
        lines += [
            f"The same {w.requests:,} requests as one batch file through `batchmlx.worker.Worker` "
            f"(SQLite store, submit, claim, engine, results, finalize; model loaded before): "
            f"intake {w.intake_s:.1f} s, run {w.wall_s:.1f} s "
            f"({w.requests / w.wall_s:.0f} requests/s), batch {w.status}, "
            f"{w.completed:,} completed.",
            "",
            "| elapsed s | completed | RSS MiB | MLX active MiB | worker pending "
            "| engine entries |",
            "|---|---|---|---|---|---|",
            *(
                f"| {x.elapsed_s:.1f} | {x.completed:,} | {_mib(x.rss)} | {_mib(x.mlx_active)} "
                f"| {x.pending} | {x.engine_entries} |"
                for x in w.samples
            ),
            "",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write the markdown here too")
    ap.add_argument("--no-worker", action="store_true", help="the engine runs only")
    ap.add_argument("--no-fast-blas", action="store_true")
    args = ap.parse_args(argv)
    if not args.no_fast_blas:
        from benchmarks.common import fast_blas

        fast_blas()  # re-executes this command line once, before any timing
    lines = section(args.quick, with_worker=not args.no_worker)
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
