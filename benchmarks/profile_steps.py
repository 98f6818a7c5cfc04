"""batchmlx's decode and prefill steps beside OpenVINO GenAI's, and where batchmlx's time goes:
`python -m benchmarks.profile_steps [--quick] [--out benchmarks/RESULTS-profile.md]`.

- **Workload**, the same token ids for both engines: W different questions through the default
  model's chat template (`workloads.chat_prompt`), greedy, every request generating
  `max_tokens` (batchmlx: no stop ids; OpenVINO: ignore_eos), all submitted at once, at widths
  W = 8, 64, 128. Each repeat takes fresh questions, the same for both engines.
- **batchmlx**: `Engine` on the default model in float32 (as benchmarks/width.py builds it:
  `max_batch_size` W, adaptive width off, every other setting its default: 2,048 tokens a step),
  a fresh engine per run, each `step()` timed alone.
- **OpenVINO GenAI** (its own venv, `benchmarks/peers/ov_steps.py`): a `ContinuousBatchingPipeline`
  (what `LLMPipeline` runs with a `SchedulerConfig`) on the same GGUF, max_num_seqs = W,
  max_num_batched_tokens = 2,048 (batchmlx's step budget), prefix caching on; each `step()` timed
  alone; and one `generate()` per width for its own PerfMetrics (TTFT, TPOT, per-step raw
  durations).
- **The same step classes for both**: the *prefill phase* is every step until each request has
  its first token (ms per step and per prompt token); a *decode step* is one in which all W
  requests already had a token and each gets one more. The two engines alternate, width by
  width, in one process tree, `repeats` times; medians are kept.
- **Where batchmlx's time goes**: EngineStats' own model_s and sample_s in the timing runs,
  then two separate profiling passes (benchmarks/step_probes.py): eval barriers around each
  piece, and cProfile for the Python share.
- **The floor**: matmul FLOPs per step at the sgemm peak `batchmlx doctor` measures, and the
  weight bytes per step at the bandwidth a float32 GEMV over weights larger than the L3 reaches.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import step_probes as sp

OUT = Path(__file__).with_name("RESULTS-profile.md")
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True, slots=True)
class Settings:
    widths: tuple[int, ...] = (8, 64, 128)
    max_tokens: int = 32
    repeats: int = 3
    budget: int = 2048  # tokens a step: batchmlx's max_prefill_tokens default, OpenVINO's too


QUICK = Settings(widths=(8, 64), max_tokens=8, repeats=1)


def log(msg: str) -> None:
    print(f"[profile-steps] {msg}", file=sys.stderr, flush=True)


# -- steps and their classes ---------------------------------------------------------------------

# one step: [ms, requests with a first token before it, after it, tokens it generated]
StepRow = list[float]


def prefill_phase(steps: list[StepRow], width: int) -> list[StepRow]:
    for i, s in enumerate(steps):
        if s[2] >= width:
            return steps[: i + 1]
    return steps


def decode_steps(steps: list[StepRow], width: int) -> list[StepRow]:
    return [s for s in steps if s[1] >= width and s[3] == width]


@dataclass(slots=True)
class RunFigures:
    """One run's step figures (ms)."""

    decode_ms: float  # median decode step
    prefill_ms: float  # the whole prefill phase
    prefill_steps: int
    extra: dict[str, float] = field(default_factory=dict)


def figures(steps: list[StepRow], width: int) -> RunFigures:
    pre = prefill_phase(steps, width)
    dec = decode_steps(steps, width)
    return RunFigures(statistics.median(s[0] for s in dec) if dec else float("nan"),
                      sum(s[0] for s in pre), len(pre))  # fmt: skip


# -- batchmlx --------------------------------------------------------------------------------------


class BmxRun:
    """One fresh engine (float32 default model, width W, adaptive width off), each step timed."""

    def __init__(self, loaded: Any, width: int, budget: int) -> None:
        from batchmlx.core.engine_api import EngineSettings
        from batchmlx.engine.runners.paged import paged_engine

        gc.collect()
        cfg = EngineSettings(max_batch_size=width, adaptive_width=False,
                             max_prefill_tokens=budget)  # fmt: skip
        self.engine = paged_engine(loaded.model, loaded.tokenizer,
                             context_length=loaded.context_length, config=cfg)  # fmt: skip
        self.width = width

    def run(self, prompts: list[list[int]], max_tokens: int, hook: Any = None) -> list[StepRow]:
        """Every prompt added at once, then steps until done. hook(kind), a context manager
        factory, wraps each step for the profiling passes (kind: "prefill" while some request
        has no token yet, "decode" while all W decode and none has finished, else "tail")."""
        import mlx.core as mx

        from batchmlx.core.request import GenerationRequest, SamplingParams

        eng, w = self.engine, self.width
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        ids = [f"r{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts, strict=True):
            eng.add(GenerationRequest(rid, list(p), params))
        done: set[str] = set()

        def started() -> int:
            return sum(1 for r in ids if r in done or eng.generated_so_far(r) > 0)

        steps: list[StepRow] = []
        mx.synchronize()
        while eng.has_unfinished():
            before, gen0 = started(), eng.runner.stats.generated_tokens
            m0, s0 = eng.runner.stats.model_s, eng.runner.stats.sample_s
            kind = "prefill" if before < w else "decode" if not done else "tail"
            t0 = time.perf_counter()
            if hook is not None:
                with hook(kind):
                    outs = eng.step()
            else:
                outs = eng.step()
            dt = time.perf_counter() - t0
            done.update(o.request_id for o in outs)
            new = eng.runner.stats.generated_tokens - gen0
            model_ms, sample_ms = (
                (eng.runner.stats.model_s - m0) * 1e3,
                (eng.runner.stats.sample_s - s0) * 1e3,
            )
            steps.append([dt * 1e3, before, started(), new, model_ms, sample_ms])
        return steps


def bmx_figures(steps: list[StepRow], width: int) -> RunFigures:
    f = figures(steps, width)
    dec = decode_steps(steps, width)
    if dec:
        f.extra["model_ms"] = statistics.median(s[4] for s in dec)
        f.extra["sample_ms"] = statistics.median(s[5] for s in dec)
    return f


# -- OpenVINO GenAI ------------------------------------------------------------------------------


class OVWorker:
    """ov_steps.py in OpenVINO GenAI's venv, spoken to one JSON line at a time."""

    def __init__(self, gguf: Path, threads: int) -> None:
        from benchmarks.peers.run_peer import peer_env
        from benchmarks.peers.setup import ensure

        inst = ensure("openvino")
        self.version = inst.version
        self.proc = subprocess.Popen(
            [inst.python, str(HERE / "peers" / "ov_steps.py"), str(gguf), str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=peer_env(),
        )  # fmt: skip

    def ask(self, **job: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("ov_steps.py ended")
            if line.startswith("{"):
                ans = json.loads(line)
                if "error" in ans:
                    raise RuntimeError(ans["error"])
                return ans

    def close(self) -> None:
        try:
            self.ask(cmd="quit")
        except Exception:  # noqa: BLE001 - it ends either way
            pass
        self.proc.wait(timeout=60)


# -- the machine ---------------------------------------------------------------------------------


def sgemm_gflops() -> float:
    from batchmlx.engine.host.fast_blas import measure_matmul_gflops

    return measure_matmul_gflops()


def gemv_bandwidth(matrices: int = 8, rows: int = 8192, cols: int = 2048) -> float:
    """GB/s a float32 x[1, cols] @ W[rows, cols]^T reaches with W cycled over `matrices`
    distinct matrices (512 MB: twice the L3), so the weights come from memory (best of 3)."""
    import mlx.core as mx

    ws = [mx.random.normal((rows, cols)) for _ in range(matrices)]
    x = mx.random.normal((1, cols))
    mx.eval(ws, x)
    best = float("inf")
    for _ in range(4):
        t0 = time.perf_counter()
        for w in ws:
            mx.eval(x @ w.T)
        best = min(best, time.perf_counter() - t0)
    nbytes = matrices * rows * cols * 4
    del ws
    return nbytes / best / 1e9


def blas_threads(n: int | None = None) -> int:
    """The preloaded OpenBLAS's thread count (set to n first when given); 0 without one."""
    import ctypes

    from batchmlx.engine.host.fast_blas import active_blas

    blas = active_blas()
    if blas is None or blas.name != "openblas" or not blas.library:
        return 0
    lib = ctypes.CDLL(blas.library)
    if n is not None:
        lib.openblas_set_num_threads(int(n))
    return int(lib.openblas_get_num_threads())


def load_now() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (5-min {five:.1f})"


def cpu_busy(seconds: float = 2.0) -> float:
    """Share of all CPUs busy over `seconds`, from /proc/stat (everyone's work)."""

    def read() -> tuple[int, int]:
        vals = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = vals[3] + vals[4]
        return sum(vals), idle

    t0, i0 = read()
    time.sleep(seconds)
    t1, i1 = read()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


# -- the run -------------------------------------------------------------------------------------


class Prompts:
    """Fresh questions for every run, the same for both engines."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.offset = 0

    def take(self, n: int) -> list[list[int]]:
        from benchmarks import workloads as wl

        out = [wl.chat_prompt(self.tokenizer, wl.question(self.offset + i)) for i in range(n)]
        self.offset += n
        return out


@dataclass(slots=True)
class Results:
    s: Settings
    machine: dict[str, Any] = field(default_factory=dict)
    ov_info: dict[str, Any] = field(default_factory=dict)
    bmx: dict[int, list[RunFigures]] = field(default_factory=dict)
    bmx1: dict[int, list[RunFigures]] = field(default_factory=dict)  # OpenBLAS on one thread
    ov: dict[int, list[RunFigures]] = field(default_factory=dict)
    ov_generate: dict[int, dict[str, Any]] = field(default_factory=dict)
    prompt_tokens: dict[int, list[int]] = field(default_factory=dict)  # per run
    barriers: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    barrier_wall: dict[int, dict[str, float]] = field(default_factory=dict)
    barriers1: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    barrier_wall1: dict[int, dict[str, float]] = field(default_factory=dict)
    profiled: dict[int, dict[str, dict[str, float]]] = field(default_factory=dict)
    profiled_wall: dict[int, dict[str, float]] = field(default_factory=dict)


def timing_passes(loaded: Any, ov: OVWorker, prompts: Prompts, r: Results) -> None:
    s = r.s
    for w in s.widths:  # warm-up: MLX's compiled kernels, OpenVINO's pipelines and JIT
        log(f"warm-up at width {w}")
        BmxRun(loaded, w, s.budget).run(prompts.take(w), 4)
        ov.ask(cmd="steps", width=w, budget=s.budget, prompts=prompts.take(w), max_tokens=4)
    for rep in range(s.repeats):
        for w in s.widths:
            ps = prompts.take(w)
            r.prompt_tokens.setdefault(w, []).append(sum(len(p) for p in ps))
            order = ("bmx", "bmx1", "ov")
            order = order[rep % 3 :] + order[: rep % 3]  # drift falls on all three
            for who in order:
                if who in ("bmx", "bmx1"):
                    threads = blas_threads()
                    if who == "bmx1":
                        blas_threads(1)
                    try:
                        steps = BmxRun(loaded, w, s.budget).run(ps, s.max_tokens)
                    finally:
                        blas_threads(threads)
                    into = r.bmx if who == "bmx" else r.bmx1
                    into.setdefault(w, []).append(bmx_figures(steps, w))
                else:
                    ans = ov.ask(cmd="steps", width=w, budget=s.budget, prompts=ps,
                                 max_tokens=s.max_tokens)  # fmt: skip
                    r.ov.setdefault(w, []).append(figures(ans["steps"], w))
            b, b1, o = r.bmx[w][-1], r.bmx1[w][-1], r.ov[w][-1]
            log(
                f"rep {rep} width {w}: decode step batchmlx {b.decode_ms:.1f} ms (BLAS 1 thread "
                f"{b1.decode_ms:.1f}), OpenVINO {o.decode_ms:.1f} ms; prefill phase "
                f"{b.prefill_ms:.0f} / {b1.prefill_ms:.0f} / {o.prefill_ms:.0f} ms"
            )
    for w in s.widths:
        log(f"OpenVINO generate() at width {w}")
        r.ov_generate[w] = ov.ask(cmd="generate", width=w, budget=s.budget,
                                  prompts=prompts.take(w), max_tokens=s.max_tokens)  # fmt: skip


def barrier_pass(loaded: Any, prompts: Prompts, r: Results, w: int, one_thread: bool) -> None:
    s = r.s
    bars = sp.Barriers()
    acc: dict[str, dict[str, float]] = {}
    count: dict[str, int] = {}
    wall: dict[str, float] = {}
    run = BmxRun(loaded, w, s.budget)

    def hook(kind: str) -> Any:
        return _barrier_step(kind, bars, acc, count, wall)

    threads = blas_threads()
    if one_thread:
        blas_threads(1)
    try:
        with bars.installed(run.engine):
            run.run(prompts.take(w), s.max_tokens, hook)
    finally:
        blas_threads(threads)
    into, into_wall = (r.barriers1, r.barrier_wall1) if one_thread else (r.barriers, r.barrier_wall)
    into[w] = {k: {b: v / count[k] for b, v in d.items()} for k, d in acc.items()}
    into_wall[w] = {k: wall[k] / count[k] for k in wall}


def profile_passes(loaded: Any, prompts: Prompts, r: Results) -> None:
    s = r.s
    for w in s.widths:
        for one in (False, True):
            log(f"barrier pass at width {w}" + (", OpenBLAS on 1 thread" if one else ""))
            barrier_pass(loaded, prompts, r, w, one)
        log(f"cProfile pass at width {w}")
        prof = sp.Profiled()
        BmxRun(loaded, w, s.budget).run(prompts.take(w), s.max_tokens, prof.step)
        r.profiled[w] = {k: prof.classified(k) for k in ("prefill", "decode")}
        r.profiled_wall[w] = {k: prof.wall[k] / max(1, prof.steps[k]) for k in prof.wall}


class _barrier_step:  # noqa: N801 - used as a context manager factory
    def __init__(self, kind: str, bars: sp.Barriers, acc: dict, count: dict, wall: dict) -> None:
        self.kind, self.bars, self.acc, self.count, self.wall = kind, bars, acc, count, wall

    def __enter__(self) -> None:
        self.snap = self.bars.snapshot()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        dt = time.perf_counter() - self.t0
        d = sp.per_step(self.snap, self.bars.snapshot(), dt)
        into = self.acc.setdefault(self.kind, {})
        for k, v in d.items():
            into[k] = into.get(k, 0.0) + v
        self.count[self.kind] = self.count.get(self.kind, 0) + 1
        self.wall[self.kind] = self.wall.get(self.kind, 0.0) + dt


def measure(loaded: Any, s: Settings) -> Results:
    from benchmarks.peers.models import default_gguf

    r = Results(s)
    m = r.machine
    m["cpus"] = len(os.sched_getaffinity(0))
    m["load_before"], m["busy_before"] = load_now(), cpu_busy()
    m["peak_before"] = sgemm_gflops()
    m["blas_threads"] = threads = blas_threads()
    m["bandwidth_default"] = gemv_bandwidth()
    blas_threads(1)
    m["bandwidth_1"] = gemv_bandwidth()
    blas_threads(threads)
    m["bandwidth"] = max(m["bandwidth_default"], m["bandwidth_1"])
    prompts = Prompts(loaded.tokenizer)
    ov = OVWorker(default_gguf(), m["cpus"])
    try:
        r.ov_info = ov.ask(cmd="info") | {"dist": ov.version}
        timing_passes(loaded, ov, prompts, r)
    finally:
        ov.close()
    m["load_mid"] = load_now()
    profile_passes(loaded, prompts, r)
    m["peak_after"] = sgemm_gflops()
    m["load_after"], m["busy_after"] = load_now(), cpu_busy()
    return r


# -- the report ----------------------------------------------------------------------------------


def _med(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows)]  # fmt: skip


@dataclass(frozen=True, slots=True)
class Floor:
    body: int  # matmul weights of the layers
    head: int  # the vocabulary projection (tied to the embedding)
    peak: float  # FLOP/s
    bandwidth: float  # bytes/s
    ov_bytes: int  # OpenVINO's weights: the GGUF's tensors

    def flops(self, tokens: int, sampled: int) -> float:
        return 2.0 * (self.body * tokens + self.head * sampled)

    def compute_ms(self, tokens: int, sampled: int) -> float:
        return self.flops(tokens, sampled) / self.peak * 1e3

    def f32_bytes_ms(self) -> float:
        return 4.0 * (self.body + self.head) / self.bandwidth * 1e3

    def ov_bytes_ms(self) -> float:
        return self.ov_bytes / self.bandwidth * 1e3


def header(r: Results, loaded_desc: str) -> list[str]:
    m, o, s = r.machine, r.ov_info, r.s
    return [
        "# batchmlx's steps beside OpenVINO GenAI's, and where batchmlx's time goes",
        "",
        "`python -m benchmarks.profile_steps"
        + (" --quick`" if s == QUICK else "`")
        + f" ({time.strftime('%Y-%m-%d %H:%M')}). {m['cpus']} CPUs this process may use; "
        "the machine "
        f"was shared: load average {m['load_before']} at the start, {m['load_mid']} after the "
        f"timing passes, {m['load_after']} at the end; CPUs busy with others' work just before "
        f"{m['busy_before']:.0%} and just after {m['busy_after']:.0%} (/proc/stat over 2 s, "
        "this process idle). Both engines ran alternately in the same run, width by width, "
        f"{s.repeats} repeat(s), the order (batchmlx, batchmlx with OpenBLAS on one thread, "
        "OpenVINO) rotated every repeat; figures are medians. On a loaded machine single runs "
        "moved by up to 4x (see the log lines of each repeat): read ratios, not absolute times.",
        "",
        f"- **batchmlx**: {loaded_desc}; `Engine` with max_batch_size = W, adaptive width off, "
        f"{s.budget} tokens a step (its default), paged KV with prefix cache (defaults).",
        f"- **OpenVINO GenAI** ({r.ov_info.get('dist', '?')}): `ContinuousBatchingPipeline` "
        "(what `LLMPipeline` runs with a `SchedulerConfig`) on the same GGUF "
        "(SmolLM2-135M-Instruct Q4_1: layers Q4_1, token embedding / tied head Q8_0), "
        f"max_num_seqs = W, max_num_batched_tokens = {s.budget}, prefix caching on, "
        f"{m['cpus']} inference threads. CPU plugin: INFERENCE_PRECISION_HINT "
        f"{o.get('INFERENCE_PRECISION_HINT')}, KV cache {o.get('KEY_CACHE_PRECISION')} keys / "
        f"{o.get('VALUE_CACHE_PRECISION')} values, DYNAMIC_QUANTIZATION_GROUP_SIZE "
        f"{o.get('DYNAMIC_QUANTIZATION_GROUP_SIZE')}.",
        f"- **Workload**: W different questions through the chat template (prompts of "
        f"{_prompt_range(r)} tokens), greedy, {s.max_tokens} new tokens each (no stop), all "
        "submitted at once; fresh questions every run, the same ids for both engines.",
        "- **Step classes** (the same for both): the *prefill phase* is every step until each "
        "request has its first token; a *decode step* is one where all W requests already had a "
        "token and each gets one more (median).",
        "",
    ]


def _prompt_range(r: Results) -> str:
    per = [t / w for w, ts in r.prompt_tokens.items() for t in ts]
    return f"{min(per):.0f}-{max(per):.0f} mean" if per else "?"


def main_table(r: Results) -> list[str]:
    rows = []
    for w in r.s.widths:
        b, o, b1 = r.bmx[w], r.ov[w], r.bmx1[w]
        bd, od = _med([x.decode_ms for x in b]), _med([x.decode_ms for x in o])
        bd1, bp1 = _med([x.decode_ms for x in b1]), _med([x.prefill_ms for x in b1])
        bp, op_ = _med([x.prefill_ms for x in b]), _med([x.prefill_ms for x in o])
        toks = _med([float(t) for t in r.prompt_tokens[w]])
        g = r.ov_generate.get(w, {})
        gsteps = [ms for ms, n in zip(g.get("step_ms", []), g.get("step_tokens", []),
                                      strict=False) if n == w]  # fmt: skip
        rows.append([
            str(w), f"{bd:.1f}", f"{bd1:.1f}", f"{od:.1f}", f"{bd / od:.2f}x, {bd1 / od:.2f}x",
            f"{w / bd * 1e3:.0f} / {w / bd1 * 1e3:.0f} / {w / od * 1e3:.0f}",
            f"{bp:.0f} ({b[0].prefill_steps}) / {bp1:.0f} / {op_:.0f} ({o[0].prefill_steps})",
            f"{bp / toks * 1e3:.0f} / {bp1 / toks * 1e3:.0f} / {op_ / toks * 1e3:.0f}",
            f"{bp / op_:.2f}x, {bp1 / op_:.2f}x",
            f"{g.get('tpot_ms', float('nan')):.2f} (x W = {g.get('tpot_ms', 0) * w:.1f}), "
            f"{_med(gsteps):.1f}",
        ])  # fmt: skip
    return _table(["W", "batchmlx decode step ms", "batchmlx, OpenBLAS 1 thread",
                   "OpenVINO decode step ms", "batchmlx / OV (default, 1 thread)",
                   "decode tok/s batchmlx / 1 thread / OV",
                   "prefill phase ms (steps) batchmlx / 1 thread / OV",
                   "prefill µs per prompt token, same order", "prefill batchmlx / OV",
                   "OV generate(): TPOT ms (per token), median full-width step ms"],
                  rows)  # fmt: skip


def breakdown(r: Results, kind: str, one: bool = False) -> list[str]:
    """Barrier-pass ms per step of `kind` by bucket, per width, and the same scaled to the
    timing pass's step (each bucket times timing / instrumented)."""
    rows = []
    for b in sp.BUCKETS:
        row = [b]
        for w in r.s.widths:
            row.append(f"{_bars(r, one)[0][w].get(kind, {}).get(b, 0.0) * 1e3:.1f}")
        rows.append(row)
    inst = ["instrumented step (barriers)"]
    timed = ["timing pass step (no instruments)"]
    eng = ["EngineStats in the timing pass: model_s, sample_s"]
    for w in r.s.widths:
        inst.append(f"**{_bars(r, one)[1][w].get(kind, float('nan')) * 1e3:.1f}**")
        t = _timing_step_ms(r, w, kind, one)
        timed.append(f"**{t:.1f}**")
        runs = (r.bmx1 if one else r.bmx)[w]
        eng.append(f"{_med([x.extra.get('model_ms', float('nan')) for x in runs]):.1f}, "
                   f"{_med([x.extra.get('sample_ms', float('nan')) for x in runs]):.1f}"
                   if kind == "decode" else "")  # fmt: skip
    rows += [inst, timed] + ([eng] if kind == "decode" else [])
    return _table(["ms per step", *(f"W={w}" for w in r.s.widths)], rows)


def _bars(r: Results, one: bool) -> tuple[dict, dict]:
    return (r.barriers1, r.barrier_wall1) if one else (r.barriers, r.barrier_wall)


def _timing_step_ms(r: Results, w: int, kind: str, one: bool = False) -> float:
    runs = (r.bmx1 if one else r.bmx)[w]
    if kind == "decode":
        return _med([x.decode_ms for x in runs])
    return _med([x.prefill_ms / x.prefill_steps for x in runs])


def profile_table(r: Results, kind: str) -> list[str]:
    rows = []
    for b in sp.PROFILE_BUCKETS:
        rows.append([b, *(f"{r.profiled[w].get(kind, {}).get(b, 0.0) * 1e3:.1f}"
                          for w in r.s.widths)])  # fmt: skip
    rows.append(["cProfile step (main thread)",
                 *(f"**{r.profiled_wall[w].get(kind, float('nan')) * 1e3:.1f}**"
                   for w in r.s.widths)])  # fmt: skip
    rows.append(
        [
            "Python and MLX op calls (the Python rows: an upper bound, the profiler's "
            "cost included)",
            *(f"{python_share(r, w, kind):.1f}" for w in r.s.widths),
        ]
    )
    return _table(["ms per step", *(f"W={w}" for w in r.s.widths)], rows)


def python_share(r: Results, w: int, kind: str) -> float:
    p = r.profiled[w].get(kind, {})
    return sum(v for k, v in p.items() if k not in (sp.EVAL, sp.HOST)) * 1e3


def floor_table(r: Results, f: Floor) -> list[str]:
    rows = []
    for w in r.s.widths:
        bd = _med([x.decode_ms for x in r.bmx[w]])
        od = _med([x.decode_ms for x in r.ov[w]])
        comp = f.compute_ms(w, w)
        fl = max(comp, f.f32_bytes_ms())
        rows.append([str(w), f"{f.flops(w, w) / 1e9:.1f}", f"{comp:.1f}",
                     f"{f.f32_bytes_ms():.1f}", f"{f.ov_bytes_ms():.1f}", f"{fl:.1f}",
                     f"{bd:.1f} ({bd / fl:.1f}x)", f"{od:.1f}"])  # fmt: skip
    for w in r.s.widths:
        toks = _med([float(t) for t in r.prompt_tokens[w]])
        bp = _med([x.prefill_ms for x in r.bmx[w]])
        comp = f.compute_ms(int(toks), w)
        rows.append([f"prefill W={w} ({toks:.0f} tokens)", f"{f.flops(int(toks), w) / 1e9:.1f}",
                     f"{comp:.1f}", "", "", f"{comp:.1f}", f"{bp:.0f} ({bp / comp:.1f}x)",
                     f"{_med([x.prefill_ms for x in r.ov[w]]):.0f}"])  # fmt: skip
    return _table(["decode step at W", "matmul GFLOP", "at the sgemm peak, ms",
                   "float32 weights at the bandwidth, ms", "OpenVINO's GGUF weights at it, ms",
                   "floor (the larger), ms", "batchmlx measured ms (x floor)",
                   "OpenVINO measured ms"], rows)  # fmt: skip


def scaled(r: Results, w: int, kind: str = "decode", one: bool = False) -> dict[str, float]:
    """The barrier pass's buckets (ms) scaled so they add up to the timing pass's step."""
    bars, walls = _bars(r, one)
    d = bars[w].get(kind, {})
    inst = walls[w].get(kind, 0.0)
    k = _timing_step_ms(r, w, kind, one) / (inst * 1e3) if inst else 0.0
    return {b: v * 1e3 * k for b, v in d.items()}


CAUSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("matmuls in float32 (projections, MLP, lm_head)", (sp.PROJ, sp.MLP, sp.HEAD)),
    ("attention", (sp.ATTN,)),
    ("Python per step (glue, scheduling, post-processing)", (sp.GLUE, sp.SCHED, sp.POST)),
    (
        "elementwise model ops (norms, RoPE, SwiGLU, residuals)",
        (sp.NORM, sp.ROPE, sp.SWIGLU, sp.OTHER),
    ),
    ("KV writes / gathers and the step's layout", (sp.KV, sp.LAYOUT)),
    ("sampling", (sp.SAMPLE,)),
)


def causes_table(r: Results, one: bool = False) -> list[str]:
    rank_w = 64 if 64 in r.s.widths else r.s.widths[-1]
    per = {w: scaled(r, w, one=one) for w in r.s.widths}
    runs = r.bmx1 if one else r.bmx
    vals = {name: {w: sum(per[w].get(b, 0.0) for b in bs) for w in r.s.widths}
            for name, bs in CAUSES}  # fmt: skip
    order = sorted(vals, key=lambda n: -vals[n][rank_w])
    rows = [[str(i + 1), n, *(f"{vals[n][w]:.1f}" for w in r.s.widths)]
            for i, n in enumerate(order)]  # fmt: skip
    rows.append(
        [
            "",
            "**batchmlx decode step**",
            *(f"**{_med([x.decode_ms for x in runs[w]]):.1f}**" for w in r.s.widths),
        ]
    )
    rows.append(
        [
            "",
            "**OpenVINO GenAI decode step (everything)**",
            *(f"**{_med([x.decode_ms for x in r.ov[w]]):.1f}**" for w in r.s.widths),
        ]
    )
    gap = [_med([x.decode_ms for x in runs[w]]) - _med([x.decode_ms for x in r.ov[w]])
           for w in r.s.widths]  # fmt: skip
    rows.append(["", "gap (batchmlx - OpenVINO)", *(f"{g:.1f}" for g in gap)])
    return _table(["rank", f"cause (ranked at W={rank_w}), ms per decode step",
                   *(f"W={w}" for w in r.s.widths)], rows)  # fmt: skip


def gap_notes(r: Results, f: Floor, one: bool = False) -> list[str]:
    """The ranking's figures in sentences (numbers from this run)."""
    out = []
    for w in r.s.widths:
        p = scaled(r, w, one=one)
        mm = sum(p.get(b, 0.0) for b in (sp.PROJ, sp.MLP, sp.HEAD))
        od = _med([x.decode_ms for x in r.ov[w]])
        bd = _med([x.decode_ms for x in (r.bmx1 if one else r.bmx)[w]])
        py = sum(p.get(b, 0.0) for b in (sp.GLUE, sp.SCHED, sp.POST))
        out.append(
            f"- W={w}: batchmlx {bd:.1f} ms a decode step against OpenVINO's {od:.1f} "
            f"({bd / od:.2f}x). Its float32 matmuls alone take {mm:.1f} ms "
            f"({mm / od:.2f}x OpenVINO's whole step) for {f.flops(w, w) / 1e9:.1f} GFLOP "
            f"({f.flops(w, w) / (mm / 1e3) / 1e9:.0f} GFLOP/s against a {f.peak / 1e9:.0f} "
            f"GFLOP/s sgemm peak; streaming the 4-byte weights once costs "
            f"{f.f32_bytes_ms():.1f} ms at the measured bandwidth, OpenVINO's "
            f"{f.ov_bytes / 1e6:.0f} MB of GGUF weights {f.ov_bytes_ms():.1f} ms, and fit the "
            f"L3). Attention {p.get(sp.ATTN, 0.0):.1f} ms (hand-off to the host "
            f"{p.get(sp.HANDOFF, 0.0):.1f}), Python per step {py:.1f} ms, elementwise ops "
            f"{sum(p.get(b, 0.0) for b in (sp.NORM, sp.ROPE, sp.SWIGLU, sp.OTHER)):.1f} ms, "
            f"sampling {p.get(sp.SAMPLE, 0.0):.1f} ms.")  # fmt: skip
    return out


OV_DOES = """\
What an OpenVINO GenAI step is (its source, `src/cpp/src/continuous_batching/pipeline_impl.cpp`
`ContinuousBatchingImpl::step()`, and `gguf_utils/building_blocks.cpp`), all in C++: the
scheduler picks the step's tokens (vLLM-like, dynamic split-fuse: prompt chunks beside decodes
within max_num_batched_tokens); the model runner fills the step's inputs (token ids, positions,
past lengths, block tables) and runs **one** inference request of the whole compiled graph, whose
attention is the CPU plugin's fused PagedAttention op over a KV cache stored u8 (this plugin's
KV_CACHE_PRECISION); the C++ sampler picks the tokens (greedy: an argmax per row,
`sampler_num_threads` threads); finished sequences free their blocks. The GGUF's Q4_1 and Q8_0
tensors are kept as u4 / u8 constants with f16 scales and zero points per group of 32, and the
decompression subgraph (Convert, Subtract, Multiply) is folded by the CPU plugin into its
FullyConnected kernels (weights decompressed inside the matmul); with
DYNAMIC_QUANTIZATION_GROUP_SIZE 32 those FullyConnected layers quantize their activations to
int8 per group of 32 on the fly, the rest of the graph runs at the INFERENCE_PRECISION_HINT
(bf16 on this AVX512_BF16 CPU). Precision, then: int4/int8 weights, int8 or bf16 activations in
the matmuls, bf16 elsewhere, u8 KV; batchmlx: float32 throughout, exact to mlx-lm.
"""

READING = """\
Reading it: on a machine whose other tenants keep both cores busy, the preloaded OpenBLAS's
two-thread team costs a decode step more than its FLOPs do: every small matmul (a [W, 576] x
[576, 1536] projection: ~1 ms on one thread, ~23 ms on two in a check under this load) waits for
a second thread to be scheduled, which is why "OpenBLAS on one thread" is faster at every width
here and why the barrier pass (one more wake-up per matmul) inflates the default setting most.
OpenVINO's CPU plugin runs two threads too (its own TBB pool), and its step times show no such
toll. Of what remains with one thread, the float32 matmuls are the first cause at every
width; then the elementwise ops MLX runs one pass at a time (OpenVINO fuses them into the
graph), then attention and Python per step.
"""


def report(r: Results, f: Floor, loaded_desc: str) -> str:
    m = r.machine
    lines = header(r, loaded_desc)
    lines += ["## Step time, side by side", "", *main_table(r), ""]
    lines += ["## Where batchmlx's decode step goes", "",
              "Barrier pass (a separate run: an `mx.eval` barrier around each piece, so each "
              "piece's own work is timed alone; the barriers cost time themselves, so the "
              "instrumented step is above the timing pass's), ms per decode step:", "",
              *breakdown(r, "decode"), "",
              "The same with the preloaded OpenBLAS set to one thread for the run "
              "(`openblas_set_num_threads(1)`):", "", *breakdown(r, "decode", one=True),
              ""]  # fmt: skip
    lines += ["cProfile pass (another separate run; the main thread's functions by tottime, "
              "so its own per-call cost inflates the Python rows), ms per decode step:", "",
              *profile_table(r, "decode"), ""]  # fmt: skip
    lines += ["## Where batchmlx's prefill steps go", "",
              "Barrier pass, ms per step of the prefill phase:", "", *breakdown(r, "prefill"),
              "", "OpenBLAS on one thread:", "", *breakdown(r, "prefill", one=True), "",
              "cProfile pass, ms per prefill step:", "", *profile_table(r, "prefill"),
              ""]  # fmt: skip
    lines += ["## The floor", "",
              f"sgemm peak measured in this run (`batchmlx doctor`'s 1024^3 float32 matmul on "
              f"MLX): {f.peak / 1e9:.0f} GFLOP/s (before {m['peak_before']:.0f}, after "
              f"{m['peak_after']:.0f}; the better one). Memory bandwidth: "
              f"{f.bandwidth / 1e9:.1f} GB/s (a float32 GEMV, MLX, over 512 MB of weights "
              f"cycled: twice the L3; the better of OpenBLAS's {m['blas_threads']} threads, "
              f"{m['bandwidth_default']:.1f} GB/s, and one, {m['bandwidth_1']:.1f}). "
              "Weights a step reads: batchmlx "
              f"{4 * (f.body + f.head) / 1e6:.0f} MB in float32 ({f.body / 1e6:.1f}M in the "
              f"layers + {f.head / 1e6:.1f}M in the tied head), OpenVINO "
              f"{f.ov_bytes / 1e6:.0f} MB (the GGUF's tensors as stored). Matmul FLOPs: 2 x "
              "weights x rows (decode: W rows through layers and head; prefill: every prompt "
              "token through the layers, W rows through the head), attention not counted.",
              "", *floor_table(r, f), ""]  # fmt: skip
    lines += ["## What closes the gap", "",
              "batchmlx's decode step by cause, the barrier pass's pieces scaled to the timing "
              "pass's step (each piece x timing / instrumented), ranked:", "",
              *causes_table(r), "", *gap_notes(r, f), "",
              "The same with OpenBLAS on one thread:", "", *causes_table(r, one=True), "",
              *gap_notes(r, f, one=True), "", READING, OV_DOES]  # fmt: skip
    return "\n".join(lines) + "\n"


def ov_weight_bytes(gguf: Path) -> int:
    """Bytes of the GGUF's tensors (its header and metadata not counted): what OpenVINO keeps."""
    from benchmarks.peers.setup import Installed

    llama = Installed.load("llama")
    if llama is not None and llama.gguf_py:
        sys.path.insert(0, llama.gguf_py)
        try:
            import gguf as gguf_py  # llama.cpp's gguf-py (benchmarks/peers/setup.py)

            return sum(int(t.n_bytes) for t in gguf_py.GGUFReader(str(gguf)).tensors)
        except Exception:  # noqa: BLE001 - fall back to the file's size
            pass
        finally:
            sys.path.remove(llama.gguf_py)
    return gguf.stat().st_size  # an upper bound (the tokenizer's metadata included)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.profile_steps", description=__doc__)
    p.add_argument("--quick", action="store_true", help="widths 8 and 64, 8 tokens, 1 repeat")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if argv is None:
        from benchmarks.common import fast_blas

        fast_blas()  # re-executes this command line once, before any timing
    from benchmarks.peers.models import default_gguf
    from benchmarks.prefill_mfu import ModelFlops
    from benchmarks.width import load

    s = QUICK if args.quick else Settings()
    loaded = load(dtype="float32")
    mf = ModelFlops.of(loaded.model)
    r = measure(loaded, s)
    m = r.machine
    f = Floor(mf.body_params, mf.head_params, max(m["peak_before"], m["peak_after"]) * 1e9,
              m["bandwidth"] * 1e9, ov_weight_bytes(Path(default_gguf())))  # fmt: skip
    text = report(r, f, "SmolLM2-135M-Instruct (the default model) in float32, MLX "
                  "CPU backend, OpenBLAS preloaded")  # fmt: skip
    args.out.write_text(text)
    (args.out.with_suffix(".json")).write_text(json.dumps(
        {"machine": m, "ov_info": r.ov_info, "ov_generate": r.ov_generate,
         "barriers": r.barriers, "profiled": r.profiled}, indent=1, default=str))  # fmt: skip
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
