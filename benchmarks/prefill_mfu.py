"""Prefill against its compute floor, decode model-FLOP utilisation, and where a step's time goes:
`python -m benchmarks.prefill_mfu [--quick] [--out benchmarks/RESULTS-prefill.md]`.

- **Peak**: the float32 sgemm rate `batchmlx doctor` measures (1024^3 matmul on MLX's CPU
  device), measured in this run, before and after the engine runs (the better one is used).
- **Prefill floor**: the prompt's FLOPs at that peak: 2 x the body's matmul weights per token,
  the vocabulary projection of the one sampled row, and the attention scores (q.k and p.v,
  2 x 2 x heads x head_dim per causal query-key pair, the upper triangle not counted). A fresh
  engine prefills one prompt of `prompt_tokens` random tokens (max_tokens 1); rate = tokens
  over the time of its prefill steps. Three kernel settings are measured in this one run
  (`KERNELS`): mlx-lm's attention and activation (the first engine), `chunked_attention` as MLX
  ops with `kernels.fast_swiglu` (the previous one), and the default: numpy attention on the
  host where a call has enough scores (`engine/host/attention.py`).
- **Decode MFU** at widths 32/64/128/256 (256: where the adaptive width settles on the unique
  workload), with the first and the default kernels: that many requests with distinct
  random prompts, greedy, each generating `decode_tokens`; MFU = FLOPs of the decode steps
  (body and head per token, attention over each token's context) / decode-step time / peak.
- **Where the time goes**: one instrumented prefill and one instrumented decode run with an
  `mx.eval` barrier around each piece (which costs some speed itself, so the totals are a bit
  above the timed runs): model matmuls (every Linear and the head), attention, KV writes and
  gathers (`update_and_fetch`), other model ops (norms, RoPE, activations, embedding: what is
  pending when a timed piece starts), layout building, sampling, and the rest of the step
  (scheduling, bookkeeping, Python).

Run it under the fast BLAS (`main` re-executes onto it, as every batchmlx command does).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("RESULTS-prefill.md")
# wall time; --cpu-time swaps in this process's CPU time (steadier on a shared machine, but it
# counts a second BLAS thread's work as more time, so run those with OPENBLAS_NUM_THREADS=1)
CLOCK: Callable[[], float] = time.perf_counter


@dataclass(frozen=True, slots=True)
class Settings:
    prompt_tokens: int = 1000
    prefill_repeats: int = 2  # best of
    widths: tuple[int, ...] = (32, 64, 128, 256)  # 256: where the adaptive width settles
    decode_prompt_tokens: int = 64
    decode_tokens: int = 32
    profile_width: int = 32


QUICK = Settings(
    prompt_tokens=200, prefill_repeats=1, widths=(8, 16), decode_tokens=6, profile_width=8
)


@dataclass(frozen=True, slots=True)
class Kernels:
    """One setting of the CPU kernel switches in engine/kernels/attention.py."""

    label: str
    fast: bool  # FAST_ATTENTION and FAST_SWIGLU
    host: bool  # HOST_ATTENTION (numpy attention where it pays)

    def use(self) -> None:
        from batchmlx.engine.kernels import attention

        attention.FAST_ATTENTION = attention.FAST_SWIGLU = self.fast
        attention.HOST_ATTENTION = self.host


BEFORE = Kernels("mlx-lm's attention and swiglu (first)", fast=False, host=False)
DEFAULT = Kernels("host attention where it pays, fast_swiglu (default)", fast=True, host=True)
KERNELS = (
    BEFORE,
    Kernels("chunked_attention in MLX, fast_swiglu (previous)", fast=True, host=False),
    DEFAULT,
)


def log(msg: str) -> None:
    print(f"[prefill-mfu] {msg}", file=sys.stderr, flush=True)


# -- FLOP counts ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelFlops:
    body_params: int  # matmul weights of the transformer layers (what each token multiplies)
    head_params: int  # vocabulary projection
    layers: int
    q_heads: int
    head_dim: int

    @staticmethod
    def of(model: Any) -> ModelFlops:
        import mlx.nn as nn
        from mlx.utils import tree_flatten

        from batchmlx.engine.runners.paged_forward import model_dims

        inner = model.model
        body = sum(
            m.weight.size
            for layer in inner.layers
            for _, m in tree_flatten(layer.leaf_modules(), is_leaf=nn.Module.is_module)
            if isinstance(m, nn.Linear)
        )
        head = getattr(model, "lm_head", None)
        head_params = head.weight.size if head is not None else inner.embed_tokens.weight.size
        layers, _, head_dim = model_dims(model)
        q_heads = inner.layers[0].self_attn.n_heads
        return ModelFlops(body, head_params, layers, q_heads, head_dim)

    def tokens(self, n: int, sampled: int) -> float:
        """Matmul FLOPs of n tokens through the body and `sampled` rows through the head."""
        return 2.0 * (self.body_params * n + self.head_params * sampled)

    def attention(self, pairs: int) -> float:
        """q.k and p.v over `pairs` (query, key) pairs, every layer and head."""
        return 4.0 * self.q_heads * self.head_dim * pairs * self.layers


# -- timers ----------------------------------------------------------------------------------------


BUCKETS = (
    "model matmuls", "attention", "KV writes and gathers", "other model ops",
    "layout", "sampling", "scheduling, bookkeeping, Python",
)  # fmt: skip


@dataclass(slots=True)
class Timers:
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    depth: int = 0  # nested timed calls count once, in the outer bucket

    def timed(self, bucket: str, fn: Callable) -> Callable:
        import mlx.core as mx

        def wrapper(*args, **kw):
            if self.depth:
                return fn(*args, **kw)
            t0 = CLOCK()
            mx.eval(_arrays([args, kw]))  # what was pending is other model work
            t1 = CLOCK()
            self.depth += 1
            try:
                out = fn(*args, **kw)
                mx.eval(_arrays(out))
            finally:
                self.depth -= 1
            self.seconds["other model ops"] += t1 - t0
            self.seconds[bucket] += CLOCK() - t1
            return out

        return wrapper


def _arrays(obj: Any, depth: int = 0) -> list:
    """The MLX arrays in obj: itself, in containers, or in a slots dataclass's fields."""
    import mlx.core as mx

    if isinstance(obj, mx.array):
        return [obj]
    if depth > 3:
        return []
    if isinstance(obj, list | tuple):
        return [a for x in obj for a in _arrays(x, depth + 1)]
    if isinstance(obj, dict):
        return [a for x in obj.values() for a in _arrays(x, depth + 1)]
    slots = getattr(type(obj), "__slots__", ())
    if slots and hasattr(obj, "__dataclass_fields__"):
        return [a for n in slots for a in _arrays(getattr(obj, n, None), depth + 1)]
    return []


@contextmanager
def instrumented(engine: Any, timers: Timers) -> Iterator[None]:
    """Eval barriers and timers around each piece of the engine's step, undone afterwards."""
    import mlx.nn as nn

    from batchmlx.engine import core as engine_core
    from batchmlx.engine.kv import paged as kv_cache

    patches: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, name: str, bucket: str) -> None:
        old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        patches.append((owner, name, old))
        fn = old.__func__ if isinstance(old, staticmethod) else old
        new = timers.timed(bucket, fn)
        setattr(owner, name, staticmethod(new) if isinstance(old, staticmethod) else new)

    patch(nn.Linear, "__call__", "model matmuls")
    patch(engine.runner.forward_pass, "head", "model matmuls")
    patch(engine.runner.forward_pass.attention, "paged", "attention")
    patch(kv_cache.PagedLayerCache, "update_and_fetch", "KV writes and gathers")
    patch(kv_cache.BatchLayout, "build", "layout")
    patch(kv_cache.PackedLayout, "build", "layout")  # mixed steps run packed
    patch(engine_core, "sample", "sampling")
    patch(engine.grammars, "mask", "sampling")
    try:
        yield
    finally:
        for owner, name, old in reversed(patches):
            setattr(owner, name, old)


# -- runs ------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Phases:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    step_s: float = 0.0
    tokens: list[list[int]] = field(default_factory=list)


def run_engine(loaded: Any, prompts: list[list[int]], max_tokens: int, width: int) -> Phases:
    """Every prompt submitted at once; each step timed and filed as prefill or decode."""
    import mlx.core as mx

    from batchmlx.core.engine_api import EngineSettings
    from batchmlx.core.request import GenerationRequest, SamplingParams
    from batchmlx.engine.runners import paged

    eng = paged.paged_engine(
        loaded.model, loaded.tokenizer, context_length=loaded.context_length,
        config=EngineSettings(max_batch_size=width, max_prefill_tokens=max(2048, width * 64)),
    )  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, p in enumerate(prompts):
        eng.add(GenerationRequest(request_id=f"r{i}", prompt_tokens=p, params=params))
    ph = Phases()
    outs = {}
    mx.synchronize()
    while eng.has_unfinished():
        decodes = eng.runner.stats.decode_steps
        t0 = CLOCK()
        for o in eng.step():
            outs[o.request_id] = o
        dt = CLOCK() - t0
        if eng.runner.stats.decode_steps > decodes:
            ph.decode_s += dt
        else:
            ph.prefill_s += dt
    ph.step_s = ph.prefill_s + ph.decode_s
    ph.tokens = [outs[f"r{i}"].token_ids for i in range(len(prompts))]
    return ph


def profile_engine(
    loaded: Any, prompts: list[list[int]], max_tokens: int, width: int
) -> tuple[Timers, Phases]:
    import batchmlx.engine.runners.paged as le

    timers = Timers()
    real_engine = le.paged_engine
    holder: dict[str, Any] = {}

    def instrumented_engine(*a, **kw):  # instrument the engine run_engine builds
        eng = real_engine(*a, **kw)
        holder["cm"] = instrumented(eng, timers)
        holder["cm"].__enter__()
        return eng

    le.paged_engine = instrumented_engine
    try:
        ph = run_engine(loaded, prompts, max_tokens, width)
    finally:
        le.paged_engine = real_engine
        if "cm" in holder:
            holder["cm"].__exit__(None, None, None)
    return timers, ph


def random_prompts(n: int, length: int, seed: int, high: int = 40_000) -> list[list[int]]:
    """n prompts of random token ids in [100, high) (under the default model's vocabulary)."""
    rnd = random.Random(seed)
    return [[rnd.randrange(100, high) for _ in range(length)] for _ in range(n)]


def decode_flops(mf: ModelFlops, prompts: list[list[int]], tokens: list[list[int]]) -> float:
    """Decode steps feed each sampled token but the last; a token at position p sees p + 1 keys."""
    total = 0.0
    for p, t in zip(prompts, tokens, strict=True):
        fed = max(0, len(t) - 1)
        first = len(p)
        total += mf.tokens(fed, fed) + mf.attention(sum(range(first + 1, first + fed + 1)))
    return total


# -- the section -----------------------------------------------------------------------------------


def sgemm_gflops() -> float:
    """`batchmlx doctor`'s measurement (best of 5 1024^3 float32 matmuls) on this run's clock."""
    if CLOCK is time.perf_counter:
        from batchmlx.engine.host.fast_blas import measure_matmul_gflops

        return measure_matmul_gflops()
    import mlx.core as mx

    a, b = mx.random.normal((1024, 1024)), mx.random.normal((1024, 1024))
    mx.eval(a @ b)
    best = float("inf")
    for _ in range(5):
        t0 = CLOCK()
        mx.eval(a @ b)
        best = min(best, CLOCK() - t0)
    return 2.0 * 1024**3 / best / 1e9


def _table(rows: list[list[str]], head: list[str]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def section(loaded: Any, s: Settings, found: dict[str, Any] | None = None) -> list[str]:
    """Markdown lines: prefill vs floor (both attentions), decode MFU per width, time breakdown.
    found, when given, receives the headline figures: prefill_vs_floor (fast kernels) and mfu
    {width: fraction of the peak} (fast kernels), for the targets table."""

    mf = ModelFlops.of(loaded.model)
    log("warm-up")
    run_engine(loaded, random_prompts(2, 80, 0), 2, 2)
    peaks = [sgemm_gflops()]

    n = s.prompt_tokens
    prompt = random_prompts(1, n, 1)
    pf_flops = mf.tokens(n, 1) + mf.attention(n * (n + 1) // 2)
    prefill: dict[Kernels, float] = {}
    tokens: dict[Kernels, list[int]] = {}
    for _ in range(s.prefill_repeats):
        for kernels in KERNELS:
            kernels.use()
            log(f"prefill {n} tokens, {kernels.label}")
            ph = run_engine(loaded, prompt, 1, 1)
            prefill[kernels] = min(prefill.get(kernels, float("inf")), ph.prefill_s)
            tokens[kernels] = ph.tokens[0]
    DEFAULT.use()

    decode: dict[tuple[int, bool], tuple[float, float, float]] = {}
    for w in s.widths:
        prompts = random_prompts(w, s.decode_prompt_tokens, 100 + w)
        for kernels in (BEFORE, DEFAULT):
            kernels.use()
            log(f"decode at width {w}, {kernels.label}")
            ph = run_engine(loaded, prompts, s.decode_tokens, w)
            flops = decode_flops(mf, prompts, ph.tokens)
            fed = sum(len(t) - 1 for t in ph.tokens)
            decode[w, kernels is DEFAULT] = (flops, ph.decode_s, fed / ph.decode_s)
    DEFAULT.use()

    log("profiles")
    pf = profile_engine(loaded, prompt, 1, 1)
    prompts = random_prompts(s.profile_width, s.decode_prompt_tokens, 7)
    dc = profile_engine(loaded, prompts, s.decode_tokens, s.profile_width)
    peaks.append(sgemm_gflops())
    peak = max(peaks) * 1e9
    if found is not None:
        found["prefill_vs_floor"] = prefill[DEFAULT] / (pf_flops / peak)
        found["mfu"] = {w: f / t / peak for (w, fast), (f, t, _) in decode.items() if fast}
    return _markdown(s, mf, peaks, prefill, tokens, decode, pf, dc)


def _markdown(s: Settings, mf: ModelFlops, peaks: list[float], prefill: dict, tokens: dict,
              decode: dict, pf: tuple, dc: tuple) -> list[str]:  # fmt: skip
    """The section's lines from what `section` measured."""
    n, peak = s.prompt_tokens, max(peaks) * 1e9
    pf_flops = mf.tokens(n, 1) + mf.attention(n * (n + 1) // 2)
    floor_s = pf_flops / peak
    (pf_timers, pf_ph), (dc_timers, dc_ph) = pf, dc
    lines = [
        "## Prefill against its compute floor, decode MFU, where the time goes",
        "",
        f"sgemm peak measured in this run: {peak / 1e9:.0f} GFLOP/s "
        f"(before {peaks[0]:.0f}, after {peaks[1]:.0f}; the better one is used).",
        "",
        f"**Prefill of one {n}-token prompt** ({pf_flops / 1e9:.1f} GFLOP: "
        f"{mf.tokens(n, 1) / 1e9:.1f} in matmuls, {mf.attention(n * (n + 1) // 2) / 1e9:.1f} in "
        f"attention scores; floor {floor_s:.3f} s = {n / floor_s:.0f} tok/s at the peak):",
        "",
    ]
    rows = []
    for kernels in KERNELS:
        t = prefill[kernels]
        rows.append([kernels.label, f"{t:.3f}", f"{n / t:.0f}", f"{t / floor_s:.2f}x",
                     f"{pf_flops / t / peak:.0%}"])  # fmt: skip
    lines += _table(rows, ["kernels", "prefill s", "tok/s", "vs floor", "of peak"])
    same = "identical" if len({tuple(t) for t in tokens.values()}) == 1 else "DIFFERENT"
    lines += ["", f"Greedy first token with each: {same}.", ""]

    lines += [f"**Decode** ({s.decode_prompt_tokens}-token prompts, {s.decode_tokens} new "
              "tokens each, greedy; decode steps only):", ""]  # fmt: skip
    rows = [
        [str(w), "default" if fast else "mlx-lm's (first)", f"{tok_s:.0f}",
         f"{flops / t / 1e9:.0f}", f"{flops / t / peak:.0%}"]
        for (w, fast), (flops, t, tok_s) in decode.items()
    ]  # fmt: skip
    lines += _table(rows, ["width", "kernels", "decode tok/s", "GFLOP/s", "MFU"])

    lines += ["", "**Where the time goes** (eval barriers around each piece; seconds and share "
              f"of the instrumented steps): prefill of {n} tokens, and decode at width "
              f"{s.profile_width} over its {s.decode_tokens} tokens.", ""]  # fmt: skip
    dc_total = dc_ph.step_s
    pf_total = pf_ph.step_s
    dc_timers.seconds["scheduling, bookkeeping, Python"] = max(
        0.0, dc_total - sum(dc_timers.seconds.values())
    )
    pf_timers.seconds["scheduling, bookkeeping, Python"] = max(
        0.0, pf_total - sum(pf_timers.seconds.values())
    )
    rows = []
    for b in BUCKETS:
        p, d = pf_timers.seconds.get(b, 0.0), dc_timers.seconds.get(b, 0.0)
        rows.append([b, f"{p:.3f}", f"{p / pf_total:.0%}", f"{d:.3f}", f"{d / dc_total:.0%}"])
    rows.append(["all steps", f"{pf_total:.3f}", "100%", f"{dc_total:.3f}", "100%"])
    lines += _table(rows, ["piece", "prefill s", "share", "decode s", "share"])
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefill_mfu", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cpu-time", action="store_true", help="time with process CPU time")
    args = p.parse_args(argv)
    if args.cpu_time:
        global CLOCK
        CLOCK = time.process_time
    if argv is None:
        from batchmlx.engine.host.fast_blas import ensure_fast_blas

        ensure_fast_blas()  # re-executes this command line once, before any timing
    import os

    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import load_model

    cache = Path(os.environ.get("BATCHMLX_CACHE_DIR", "~/.cache/batchmlx-test")).expanduser()
    spec = resolve_model(args.model, cache_dir=cache)
    if spec is None:
        raise SystemExit(f"cannot resolve model {args.model!r}")
    loaded = load_model(spec, cache_dir=cache, dtype=args.dtype)
    lines = section(loaded, QUICK if args.quick else Settings())
    text = "\n".join(["# Prefill floor and decode MFU" + (" (--quick)" if args.quick else ""), "",
                      *lines]) + "\n"  # fmt: skip
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
