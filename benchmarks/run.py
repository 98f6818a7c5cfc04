"""`python -m benchmarks.run`: measure the report's sections and write benchmarks/RESULTS.md, one
current page (benchmarks/page.py): the sections measured replace theirs, the others stay, each
naming its run, and the replaced text goes to benchmarks/history/.

Sections: 1 throughput (simple vs continuous vs mlx_lm.batch_generate), 2 TTFT and generation
speed, 3 shared system prompt, 4 KV memory with and without block sharing, 5 prefix cache
outcomes, 6 whole process (a batch file in, results out, vs batch_generate and an earlier
revision), 7 running width, 8 mixed steps, 9 prefill vs its floor and decode MFU, 10 scale
(10,000 requests, 50,000-line ingest), 11 targets, 12 CPU peers, 13 online serving beside
llama-server (benchmarks/peers/online.py), 14 every precision and how close each system's
answers are to float32 (benchmarks/peers/fidelity.py). Results are memoized per run, so sections
that need the same measurement (2 and 11 reuse 1, 3, 6 and 9) run it once.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import mlx.core as mx

from benchmarks import page
from benchmarks.bench import _T0, Bench, log
from benchmarks.common import QUICK, Settings, fast_blas
from benchmarks.load_report import _commit
from benchmarks.sections import ALL_SECTIONS, SECTIONS

# -- environment -------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    size = mx.device_info().get("memory_size")
    return f"{size / 2**30:.1f} GiB" if size else "unknown"


def _active_blas() -> str:
    try:
        from batchmlx.engine.host.fast_blas import active_blas
    except Exception as e:  # noqa: BLE001 - any failure just means "not reported"
        return f"unknown ({type(e).__name__})"
    try:
        b = active_blas()
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__}: {e})"
    env = " ".join(f"{k}={v}" for k, v in getattr(b, "env", {}).items())
    parts = [getattr(b, "name", str(b)), getattr(b, "library", None), env, getattr(b, "note", "")]
    return "; ".join(str(x) for x in parts if x)


def environment(s: Settings, loaded: Any) -> list[str]:
    import mlx_lm
    from mlx.utils import tree_flatten

    params = tree_flatten(loaded.model.parameters())
    wdtype = str(params[0][1].dtype).removeprefix("mlx.core.") if params else "?"
    return [
        f"- Date: {dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- Machine: {_cpu_model()}, {os.cpu_count()} cores, {_memory()} memory, "
        f"{platform.platform()}",
        f"- Python {platform.python_version()}, MLX {mx.__version__} on {mx.default_device()}, "
        f"mlx-lm {mlx_lm.__version__}",
        f"- Active BLAS: {_active_blas()}",
        f"- Model: {loaded.spec.name} ({loaded.spec.kind}), --dtype {s.dtype} -> weights "
        f"{wdtype}, context {loaded.context_length}",
        "- Settings: " + ", ".join(f"{k}={v}" for k, v in asdict(s).items()),
        "- Peer: `mlx_lm.generate.BatchGenerator` with batch_generate's defaults "
        f"(prefill_batch_size 8, completion_batch_size {s.max_batch_size}), greedy, "
        "stop_tokens=[] so it generates max_tokens like ours",
    ]


# -- CLI ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    p.add_argument("--max-tokens", type=int, help="new tokens per request in sections 1-2")
    p.add_argument("--out", type=Path, default=Path("benchmarks/RESULTS.md"))
    p.add_argument("--sections", default=",".join(map(str, ALL_SECTIONS)), help="e.g. 1,3,5")
    p.add_argument("--model", default="default", help="model alias, GGUF file or MLX folder")
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "float16", "bfloat16", "int8", "q4"])  # fmt: skip
    p.add_argument("--baseline", help="section 6: also run batchmlx from this git revision")
    p.add_argument(
        "--peer-models",
        default="",
        help="section 12: only these models, e.g. default,qwen3-1.7b (default: all)",
    )
    p.add_argument("--peer-without", default="",
                   help="section 12: leave these peers out, e.g. vllm (default: none)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if argv is None:
        fast_blas()  # re-executes this command line once, before any timing
    sections = sorted({int(x) for x in args.sections.split(",") if x.strip()})
    if unknown := set(sections) - set(ALL_SECTIONS):
        raise SystemExit(f"unknown sections: {sorted(unknown)}")
    s = replace(
        QUICK if args.quick else Settings(),
        model=args.model,
        dtype=args.dtype,
        peer_models=tuple(m for m in args.peer_models.split(",") if m),
        peer_without=tuple(m for m in args.peer_without.split(",") if m),
    )
    if args.max_tokens:
        s = replace(s, max_tokens=args.max_tokens)

    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import load_model

    cache = Path(os.environ.get("BATCHMLX_CACHE_DIR", "~/.cache/batchmlx-test")).expanduser()
    spec = resolve_model(s.model, cache_dir=cache)
    if spec is None:
        raise SystemExit(f"cannot resolve model {s.model!r}")
    log(f"loading {spec.name} (dtype {s.dtype})")
    loaded = load_model(spec, cache_dir=cache, dtype=s.dtype)
    bench = Bench(s, loaded, quick=args.quick, baseline=args.baseline)
    bench.warm_up()

    body: list[str] = []
    for n in sections:
        t = time.perf_counter()
        log(f"section {n}")
        body += SECTIONS[n](bench)
        bench.section_s[n] = time.perf_counter() - t
    timing = ", ".join(f"section {n} {t:.0f}s" for n, t in bench.section_s.items())
    total = time.perf_counter() - _T0
    now = dt.datetime.now(dt.UTC)
    cmd = " ".join(["python -m benchmarks.run", *(argv if argv is not None else sys.argv[1:])])
    run = f"`{cmd}`, {now:%Y-%m-%d %H:%M} UTC, commit {_commit()}"
    took = f"- Run time: {total:.0f}s in all ({timing}; a section reuses earlier measurements)"
    env = [*environment(s, loaded), took]
    page.write(args.out, page.sections_of(body, run), run, env, f"{now:%Y-%m-%d}")
    log(f"wrote {args.out} in {total:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
