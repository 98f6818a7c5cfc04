"""Where a batchmlx process's memory goes: a breakdown at load, engine start and the run's peak.

    python -m benchmarks.memory [--requests 64 --max-tokens 128] [--dtype auto] [--whole]
                                [--model default|FOLDER|FILE.gguf|qwen3-1.7b ...]

Runs the unique workload of benchmarks/RESULTS.md section 12 (`whole_process.Workload`: N
different chats, up to M new tokens, greedy) in this process, on the engine the worker builds
(`worker/build.build_engine`, the default engine settings), and prints one table: the process's
resident memory (VmRSS, its high-water mark VmHWM) split by what holds it, at four points
(after the imports, after the model load, after the engine is built, at the run's peak RSS,
sampled after each step), and the engine's own figures (weights by kind, the KV pool, the
decodes' dense copy, MLX's active/cache/peak memory). The resident split reads
/proc/self/smaps: file-backed mappings by file (the packed weights' cache file, the float32
copy, libraries by name), the C heap, and anonymous memory (MLX's buffers among it).

`--whole` also runs the same requests through `batchmlx submit --wait` as a fresh process (as
benchmarks/peers/run_peer.py does) and reports its VmHWM (from /proc while it runs, and its
ru_maxrss at exit): the figure the peers are compared on.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.whole_process import CACHE, REPO, Workload, _env

MB = 1 << 20

# what a file-backed mapping is counted as, first match wins (the path, lower-cased)
_FILE_KINDS = (
    ("weights: packed (host cache file)", re.compile(r"/host/.*\.safetensors$")),
    ("weights: float32 copy (file)", re.compile(r"-float32/.*\.safetensors$")),
    ("weights: other model files", re.compile(r"\.(safetensors|gguf)$")),
    ("lib: mlx", re.compile(r"/mlx")),
    ("lib: oneDNN", re.compile(r"dnnl|onednn")),
    ("lib: OpenBLAS / gfortran", re.compile(r"openblas|gfortran|quadmath")),
    ("lib: numpy", re.compile(r"/numpy")),
    ("lib: python", re.compile(r"libpython|/bin/python|python3\.\d+/lib-dynload")),
    ("lib: tokenizers / transformers", re.compile(r"tokenizers|transformers|safetensors")),
    ("lib: other", re.compile(r".")),
)


@dataclass(slots=True)
class Snapshot:
    """The process's memory at one point."""

    name: str
    status: dict[str, int]  # /proc/self/status Vm*/Rss* fields, bytes
    kinds: dict[str, int]  # resident bytes by what holds them (smaps)
    engine: dict[str, int] = field(default_factory=dict)  # the engine's own figures, bytes


def proc_status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key.startswith(("Vm", "Rss")) and rest.strip().endswith("kB"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def resident_kinds(pid: int | str = "self") -> dict[str, int]:
    """Resident bytes by kind of mapping (smaps: the mapping's Rss)."""
    kinds: dict[str, int] = defaultdict(int)
    kind = "anon"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        first = line.split(None, 1)[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header line
            parts = line.split(None, 5)
            path = parts[5].strip() if len(parts) > 5 else ""
            kind = _kind_of(path)
        elif first == "Rss:":
            kinds[kind] += int(line.split()[1]) * 1024
    return dict(kinds)


def _kind_of(path: str) -> str:
    if not path:
        return "anonymous (MLX buffers, numpy, Python objects)"
    if path == "[heap]":
        return "C heap (brk)"
    if path.startswith("["):
        return "stacks, vdso"
    low = path.lower()
    for name, pattern in _FILE_KINDS:
        if pattern.search(low):
            return name
    return "lib: other"


def snapshot(name: str, engine: Any = None, model: Any = None) -> Snapshot:
    snap = Snapshot(name, proc_status(), resident_kinds())
    snap.engine = mlx_figures() | model_figures(model) | engine_figures(engine)
    return snap


def mlx_figures() -> dict[str, int]:
    if "mlx.core" not in sys.modules:
        return {}
    import mlx.core as mx

    return {"MLX active": mx.get_active_memory(), "MLX cache (freed, kept)":
            mx.get_cache_memory(), "MLX peak": mx.get_peak_memory()}  # fmt: skip


def model_figures(model: Any) -> dict[str, int]:
    """The model's weights by kind: host GEMM weights (mapped from the cache file, or owned by
    MLX), an embedding's lookup rows (mapped or MLX's), float parameters (norms, layers left
    in MLX). Mapped bytes are resident only as far as they are read (see the smaps rows)."""
    if model is None:
        return {}
    import numpy as np
    from mlx.utils import tree_flatten

    from batchmlx.engine.host.linear import HostEmbedding, HostLinear

    out: dict[str, int] = defaultdict(int)
    seen: set[int] = set()

    def add(kind: str, a: Any) -> None:
        if a is not None and id(a) not in seen:
            seen.add(id(a))
            where = "mapped" if isinstance(a, np.ndarray) else "MLX"
            out[f"weights: {kind} ({where})"] += a.nbytes

    for _, m in model.named_modules():
        if isinstance(m, (HostLinear, HostEmbedding)):
            add("host GEMMs, packed", m._gemm.packed)
            add("host GEMMs, scales", m._gemm.scales)
        if isinstance(m, HostEmbedding):  # (W8: the very same table as the head's)
            add("embedding lookup rows", m.weight)
    for _, a in tree_flatten(model.parameters()):
        add("float (norms, other)", a)
    return dict(out)


def engine_figures(engine: Any) -> dict[str, int]:
    runner = getattr(engine, "runner", None)
    if runner is None or not hasattr(runner, "storage"):
        return {}
    out = {"KV pool (allocated)": runner.storage.nbytes,
           "KV pool (peak allocated)": runner.storage.peak_nbytes}  # fmt: skip
    if runner.decode_kv is not None:
        out["decodes' dense copy"] = runner.decode_kv.nbytes
        if runner.stats is not None:
            out["decodes' dense copy (peak)"] = runner.stats.peak_decode_kv_bytes
    return out


def run_in_process(requests: int, max_tokens: int, dtype: str,
                   model_name: str = "default") -> tuple[list[Snapshot], dict]:  # fmt: skip
    """The workload on the worker's engine in this process; snapshots at each point."""
    snaps = []
    import mlx.core as mx
    import numpy as np  # noqa: F401

    from batchmlx.core.engine_api import ENGINE_DEFAULTS
    from batchmlx.core.request import GenerationRequest, SamplingParams
    from batchmlx.worker.build import build_engine

    snaps.append(snapshot("after import"))
    serving = _build(build_engine, dtype, ENGINE_DEFAULTS, snaps, model_name)
    engine = serving.engine
    model = engine.runner.forward_pass.model if hasattr(engine, "runner") else None
    snaps.append(snapshot("engine built", engine, model))
    tok = serving.engine.tokenizer
    wl = Workload("unique", requests, max_tokens, None)
    eos = frozenset(int(i) for i in getattr(tok, "eos_token_ids", ()) or ())
    for i, messages in enumerate(wl.messages(tok)):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        engine.add(GenerationRequest(f"r{i}", ids, SamplingParams(max_tokens=max_tokens,
                                                                   temperature=0.0),
                                     stop_token_ids=eos))  # fmt: skip
    peak, tokens, outputs = 0, 0, {}
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.token_ids)
            outputs[out.request_id] = out.token_ids
        rss = proc_status()["VmRSS"]
        if rss > peak:
            peak = rss
            top = snapshot("run's peak (sampled)", engine, model)
    wall = time.perf_counter() - t0
    snaps.append(top)
    snaps.append(snapshot("run's end", engine, model))
    mx.synchronize()
    return snaps, {"tokens": tokens, "wall_s": wall, "outputs": outputs}


def _build(build_engine: Any, dtype: str, settings: Any, snaps: list[Snapshot],
           model_name: str = "default") -> Any:  # fmt: skip
    """build_engine, with a snapshot between the model's load and the engine's making."""
    import batchmlx.engine.choose as choose

    make = choose.make_engine

    def noted(model: Any, *args: Any, **kwargs: Any) -> Any:
        snaps.append(snapshot("model loaded", model=model))
        return make(model, *args, **kwargs)

    choose.make_engine = noted
    try:
        return build_engine(model_name, cache_dir=CACHE, dtype=dtype, settings=settings)
    finally:
        choose.make_engine = make


def run_whole(requests: int, max_tokens: int, dtype: str | None) -> dict[str, Any]:
    """`batchmlx submit --wait` on the same requests, a fresh process: its VmHWM (polled) and
    ru_maxrss (at exit), and its wall time."""
    work = Path(tempfile.mkdtemp(prefix="bmx-mem-"))
    (work / "requests.jsonl").write_bytes(Workload("unique", requests, max_tokens,
                                                   None).batch_file(None))  # fmt: skip
    env = _env(home=str(work / "home"), pythonpath=str(REPO))
    more = ["--dtype", dtype] if dtype else []
    cmd = [sys.executable, "-c", "from batchmlx.cli import main; main()", "submit",
           "requests.jsonl", "--wait", "--json", *more]  # fmt: skip
    t0 = time.perf_counter()
    with open(work / "out.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT)
        hwm = 0
        while True:
            try:
                hwm = max(hwm, proc_status(proc.pid).get("VmHWM", 0))
            except OSError:
                pass
            done, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = (work / "out.txt").read_text()[-2000:]
        raise RuntimeError(f"submit failed ({proc.returncode}): {tail}")
    return {"VmHWM": hwm, "ru_maxrss": usage.ru_maxrss * 1024, "wall_s": wall,
            "folder": str(work)}  # fmt: skip


def table(snaps: list[Snapshot]) -> str:
    """The snapshots side by side, MB."""
    heads = [s.name for s in snaps]
    rows: list[tuple[str, list[int | None]]] = []
    for key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
        rows.append((key, [s.status.get(key) for s in snaps]))
    rows.append(("-- resident, by mapping --", [None] * len(snaps)))
    kinds = sorted({k for s in snaps for k in s.kinds}, key=lambda k: -max(
        s.kinds.get(k, 0) for s in snaps))  # fmt: skip
    rows += [(k, [s.kinds.get(k, 0) for s in snaps]) for k in kinds]
    rows.append(("-- held by the engine --", [None] * len(snaps)))
    keys: list[str] = []
    for s in snaps:
        keys += [k for k in s.engine if k not in keys]
    rows += [(k, [s.engine.get(k) for s in snaps]) for k in keys]
    width = max(len(r[0]) for r in rows)
    col = max(12, *(len(h) for h in heads))
    lines = [
        "| " + "item".ljust(width) + " | " + " | ".join(h.rjust(col) for h in heads) + " |",
        "|" + "-" * (width + 2) + "|" + "|".join("-" * (col + 1) + ":" for _ in heads) + "|",
    ]
    for name, vals in rows:
        cells = ["" if v is None else f"{v / MB:.0f}" for v in vals]
        lines.append("| " + name.ljust(width) + " | " + " | ".join(c.rjust(col) for c in cells)
                     + " |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--whole", action="store_true", help="also a whole `submit --wait` process")
    p.add_argument("--whole-only", action="store_true", help="only the whole process")
    p.add_argument(
        "--model",
        default="default",
        help="a model alias, folder or GGUF, or a benchmark shape (benchmarks/peers/"
        "models.py: 360m, 1.7b, qwen3-1.7b, gemma3-1b, 8b); in process only",
    )
    args = p.parse_args(argv)
    model = args.model
    if model != "default" and not Path(model).exists():
        from benchmarks.peers.models import SHAPES, random_mlx_folder

        if model in SHAPES:
            model = str(random_mlx_folder(model))
    if args.whole or args.whole_only:
        whole = run_whole(args.requests, args.max_tokens, args.dtype)
        print(f"whole process (`batchmlx submit --wait`, {args.requests} x {args.max_tokens}): "
              f"VmHWM {whole['VmHWM'] / MB:.0f} MB, ru_maxrss {whole['ru_maxrss'] / MB:.0f} MB, "
              f"wall {whole['wall_s']:.1f} s")  # fmt: skip
        if args.whole_only:
            return
    from benchmarks.common import fast_blas

    fast_blas()  # the BLAS a batchmlx command runs on (a re-exec, before MLX loads)
    snaps, run = run_in_process(args.requests, args.max_tokens, args.dtype, model)
    digest = hashlib.sha256(repr(sorted(run["outputs"].items())).encode()).hexdigest()[:12]
    print(f"in process: {args.requests} chats x up to {args.max_tokens} tokens, "
          f"{run['tokens']} tokens (digest {digest}) in {run['wall_s']:.1f} s; MB:")  # fmt: skip
    print(table(snaps))


if __name__ == "__main__":
    main()
