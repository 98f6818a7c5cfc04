"""End-to-end worker throughput against mlx_lm.batch_generate, and the share of time outside the
model: `python -m benchmarks.worker_e2e` writes benchmarks/RESULTS-worker.md.

Measured in one run, on the same prompts:
- the batchmlx worker (submit → claim → engine → SQLite results → finalized files) on a
  256-request batch with a shared system prompt and on one of unique prompts, batch 32;
- mlx_lm.batch_generate on float32 weights (the same weights the worker runs) on both batches,
  and with its default set-up (the model as mlx_lm.load gives it: 4-bit weights as stored) on a
  32-request slice, since MLX's 4-bit CPU kernels make the full batch take over an hour;
- "before": the worker with MLX's reference BLAS and weights as stored (how batchmlx ran before
  the fast CPU path), in a child process, on a 32-request slice at batch 32, against the same
  slice now;
- the share of worker wall time outside the model forward, and the fraction of the machine's
  measured matmul peak the engine reaches at batch 32.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from benchmarks.workloads import question, system_prompt

CACHE = Path(os.environ.get("BATCHMLX_CACHE_DIR", "~/.cache/batchmlx-test")).expanduser()


def log(msg: str) -> None:
    print(f"[worker-bench] {msg}", file=sys.stderr, flush=True)


def messages(kind: str, n: int, tokenizer: Any) -> list[list[dict[str, str]]]:
    system = system_prompt(tokenizer, 300) if kind == "shared" else None
    out = []
    for i in range(n):
        m = [{"role": "user", "content": question(i)}]
        if system:
            m.insert(0, {"role": "system", "content": system})
        out.append(m)
    return out


def batch_file(msgs: list[list[dict[str, str]]], max_tokens: int) -> bytes:
    lines = []
    for i, m in enumerate(msgs):
        body = {"model": "gpt-4o-mini", "messages": m, "max_tokens": max_tokens, "temperature": 0}
        lines.append(orjson.dumps(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        ))  # fmt: skip
    return b"\n".join(lines) + b"\n"


async def run_worker(data: bytes, dtype: str, batch: int) -> dict[str, Any]:
    """Submit the file to a fresh home and run one worker until idle; model load excluded."""
    from batchmlx import batches
    from batchmlx.config import load_settings
    from batchmlx.core.engine_api import EngineSettings
    from batchmlx.store import Store
    from batchmlx.worker import Worker, WorkerOptions

    home = tempfile.mkdtemp(prefix="bmx-bench-")
    settings = load_settings({"BATCHMLX_HOME": home, "BATCHMLX_CACHE_DIR": str(CACHE)})
    store = await Store.open(settings.db_path)
    try:
        engine = EngineSettings(max_batch_size=batch)
        opts = WorkerOptions(until_idle=True, dtype=dtype, engine=engine)
        worker = Worker(store, settings, opts)
        worker.load("default")
        rec = await batches.intake.submit(
            store, settings, data, filename="bench.jsonl", now=time.time(), model="default"
        )
        t0 = time.perf_counter()
        await worker.run()
        wall = time.perf_counter() - t0
        rec = await store.get_batch(rec.id)
        st = worker.loaded.engine.runner.stats
        return {
            "status": rec.status.value,
            "requests": rec.request_counts.total,
            "completed": rec.request_counts.completed,
            "output_tokens": rec.usage.output_tokens,
            "prompt_tokens": rec.usage.input_tokens,
            "cached_tokens": rec.usage.cached_tokens,
            "wall_s": wall,
            "model_s": st.model_s,
            "sample_s": st.sample_s,
            "step_s": st.step_s,
            "decode_steps": st.decode_steps,
        }
    finally:
        await store.close()


def run_peer(msgs: list[list[dict[str, str]]], max_tokens: int, dtype: str) -> dict[str, Any]:
    """mlx_lm.batch_generate as a user runs it (stops at eos, like the worker's requests)."""
    import mlx_lm

    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import dequantize_model, model_folder

    folder = model_folder(resolve_model("default", cache_dir=CACHE), cache_dir=CACHE)
    model, tok = mlx_lm.load(str(folder))
    if dtype == "float32":
        import mlx.core as mx

        dequantize_model(model, mx.float32)
    prompts = []
    for m in msgs:
        ids = tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    mlx_lm.batch_generate(model, tok, prompts[:2], max_tokens=2)  # warm-up
    t0 = time.perf_counter()
    resp = mlx_lm.batch_generate(model, tok, prompts, max_tokens=max_tokens, return_token_ids=True)
    wall = time.perf_counter() - t0
    toks = sum(len(t) for t in resp.token_ids)
    from mlx.utils import tree_flatten

    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    return {"wall_s": wall, "output_tokens": toks, "params": params}


def child(args: argparse.Namespace) -> None:
    """One measurement in this process (the parent starts this without the fast BLAS)."""
    from mlx_lm import load as _  # noqa: F401  (import cost out of the timing)

    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import model_folder

    folder = model_folder(resolve_model("default", cache_dir=CACHE), cache_dir=CACHE)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    data = batch_file(messages(args.kind, args.requests, tok), args.max_tokens)
    print(json.dumps(asyncio.run(run_worker(data, args.dtype, args.batch))))


def spawn_child(kind: str, n: int, max_tokens: int, dtype: str, fast: bool) -> dict[str, Any]:
    env = dict(os.environ)
    if not fast:
        env["BATCHMLX_FAST_BLAS"] = "0"
        for k in ("LD_PRELOAD", "BATCHMLX_BLAS_REEXEC"):
            env.pop(k, None)
    cmd = [sys.executable, "-m", "benchmarks.worker_e2e", "--child", "--kind", kind,
           "--requests", str(n), "--max-tokens", str(max_tokens), "--dtype", dtype]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def tps(r: dict[str, Any]) -> float:
    return r["output_tokens"] / r["wall_s"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--before-requests", type=int, default=32)
    p.add_argument("--out", default="benchmarks/RESULTS-worker.md")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--kind", default="unique", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=32, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(args)
        return 0

    from batchmlx.engine.host.fast_blas import ensure_fast_blas

    ensure_fast_blas()  # re-executes once onto the fast BLAS
    from batchmlx.core.models import resolve_model
    from batchmlx.engine.host.fast_blas import active_blas, measure_matmul_gflops
    from batchmlx.engine.models.loader import model_folder

    folder = model_folder(resolve_model("default", cache_dir=CACHE), cache_dir=CACHE)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    peak = measure_matmul_gflops()
    log(f"matmul peak {peak:.1f} GFLOP/s ({active_blas().name})")
    rows: dict[str, dict[str, Any]] = {}
    for kind in ("shared", "unique"):
        msgs = messages(kind, args.requests, tok)
        data = batch_file(msgs, args.max_tokens)
        log(f"{kind}: worker, {args.requests} requests x {args.max_tokens} tokens")
        rows[f"{kind}/worker"] = asyncio.run(run_worker(data, "auto", 32))
        log(f"{kind}: batch_generate float32")
        rows[f"{kind}/peer32"] = run_peer(msgs, args.max_tokens, "float32")
    # MLX's 4-bit CPU kernels run at a few GFLOP/s: the default set-up and "before" are measured
    # on a slice (their 256-request runs would take over an hour here)
    n = args.before_requests
    slice_msgs = messages("unique", n, tok)
    log(f"batch_generate default (weights as stored) on {n} unique requests")
    default_peer = run_peer(slice_msgs, args.max_tokens, "stored")
    log(f"before/after on {n} unique requests at batch 32 (child processes)")
    before = spawn_child("unique", n, args.max_tokens, "stored", fast=False)
    after = spawn_child("unique", n, args.max_tokens, "auto", fast=True)

    lines = report(args, rows, peak, active_blas().note, default_peer, before, after)
    Path(args.out).write_text("\n".join(lines))
    log(f"wrote {args.out}")
    print("\n".join(lines[:12]))
    return 0


def report(args: argparse.Namespace, rows: dict[str, dict[str, Any]], peak: float, blas: str,
           default_peer: dict[str, Any], before: dict[str, Any],
           after: dict[str, Any]) -> list[str]:  # fmt: skip
    """The page's markdown lines from `main`'s measurements."""
    n = args.before_requests
    params = rows["unique/peer32"]["params"]  # float32: one element per weight
    w = rows["unique/worker"]
    decode_tps = w["output_tokens"] / w["model_s"] if w["model_s"] else 0.0
    mm_fraction = 2 * params * decode_tps / (peak * 1e9) if peak else 0.0

    lines = [
        "# Worker end-to-end benchmark (issue: fast on the Linux CPU)",
        "",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. "
        f"BLAS: {blas}; float32 1024² matmul peak measured: {peak:.1f} GFLOP/s. "
        f"Model: SmolLM2-135M-Instruct ({params / 1e6:.0f}M parameters as loaded). "
        f"{args.requests} chat requests per batch, max_tokens {args.max_tokens}, greedy, "
        "stopping at eos (the same for both sides); worker max batch 32; model load excluded.",
        "",
        "| Workload | Worker tok/s | Worker wall s | batch_generate float32 tok/s | "
        "Worker / batch_generate | Outside model forward |",
        "|---|---|---|---|---|---|",
    ]
    for kind in ("shared", "unique"):
        w, p32 = rows[f"{kind}/worker"], rows[f"{kind}/peer32"]
        outside = 1 - w["model_s"] / w["wall_s"]
        lines.append(
            f"| {kind} system prompt ({w['completed']}/{w['requests']} ok, "
            f"{w['cached_tokens']}/{w['prompt_tokens']} prompt tokens cached) | {tps(w):.1f} | "
            f"{w['wall_s']:.1f} | {tps(p32):.1f} | **{tps(w) / tps(p32):.2f}x** | "
            f"{outside:.1%} |"
        )
    lines += [
        "",
        f"mlx_lm.batch_generate with its default set-up (the model as mlx_lm.load gives it: "
        f"4-bit weights) on {n} unique requests: {tps(default_peer):.1f} tok/s; the worker now "
        f"on the same {n}: {tps(after):.1f} tok/s: **{tps(after) / tps(default_peer):.1f}x**.",
        "",
        f"Before / after on {n} unique requests at batch 32 (separate processes): before "
        f"(reference BLAS, weights as stored) {tps(before):.1f} tok/s; now {tps(after):.1f} "
        f"tok/s: **{tps(after) / tps(before):.1f}x**.",
        "",
        f"Matmul peak reached at batch 32 (unique workload): 2 x {params / 1e6:.0f}M FLOP "
        f"per token "
        f"x {decode_tps:.0f} tok/s inside the forward = {mm_fraction:.0%} of {peak:.0f} GFLOP/s.",
        "",
        "Outside model forward = 1 - (time inside the engine's forward, graph built and "
        "evaluated) / worker wall time: scheduling, sampling, tokenizer, SQLite and JSON.",
        "",
        "Raw: `"
        + json.dumps({**rows, "default_peer": default_peer, "before": before, "after": after})
        + "`",
        "",
    ]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
