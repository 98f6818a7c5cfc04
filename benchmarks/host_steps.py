"""Host steps (engine/host/step.py) beside the MLX path and OpenVINO GenAI, step by step, and
where a host step's time goes (issue 28, item 2, after the host steps).

    python -m benchmarks.host_steps [--quick] [--out PATH]

The default model as a user gets it (`--dtype auto`: bf16 weights, oneDNN GEMMs), W fresh
questions at once (W = 8, 64, 128), greedy, 32 new tokens, max_batch_size W, adaptive width
off: batchmlx with host steps, batchmlx with them off (`runner.host = None`: the MLX path of
the same engine), and OpenVINO GenAI's ContinuousBatchingPipeline on the same GGUF
(benchmarks/profile_steps.py's worker), alternately in one run, the order rotated every
repeat; medians. A separate pass per width times each piece of the host steps with
perf_counter around the calls (their own cost, a few us a call, is in the "other" row).
Writes benchmarks/RESULTS-host-steps.md (or --out).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.profile_steps import (
    BmxRun,
    OVWorker,
    Prompts,
    RunFigures,
    bmx_figures,
    cpu_busy,
    figures,
    load_now,
)

OUT = Path(__file__).with_name("RESULTS-host-steps.md")
WIDTHS, QUICK_WIDTHS = (8, 64, 128), (8, 64)
SYSTEMS = ("host", "mlx", "ov")
LABELS = {"host": "batchmlx, host steps", "mlx": "batchmlx, MLX path", "ov": "OpenVINO GenAI"}
PIECES = ("GEMMs (oneDNN: q/k/v, o, gate/up, down, lm_head)",
          "attention and KV writes (pool, dense copy)", "RMS norms", "RoPE", "SwiGLU")  # fmt: skip


def log(msg: str) -> None:
    print(f"[host-steps] {msg}", file=sys.stderr, flush=True)


def bmx_run(loaded: Any, w: int, host: bool, prompts: list[list[int]], max_tokens: int,
            hook: Any = None) -> list[list[float]]:  # fmt: skip
    run = BmxRun(loaded, w, 2048)
    if not host:
        run.engine.runner.host = None
    elif run.engine.runner.host is None:
        raise SystemExit("host steps are not on for this model (BATCHMLX_HOST_STEPS=0?)")
    return run.run(prompts, max_tokens, hook)


class Pieces:
    """perf_counter around each piece of a host step, summed over decode steps only."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.forward_ms = 0.0
        self.step_ms = 0.0
        self._on = False

    @contextmanager
    def patched(self) -> Iterator[None]:
        from batchmlx.engine.host import step as hs
        from batchmlx.engine.host.linear import SharedGemm

        targets = [
            (SharedGemm, "host", PIECES[0]), (hs._StepKV, "attend", PIECES[1]),
            (hs, "_rms_norm", PIECES[2]), (hs.HostRope, "rotate", PIECES[3]),
            (hs, "swiglu_halves", PIECES[4]), (hs.HostStep, "forward", "forward"),
        ]  # fmt: skip
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in targets]
        for obj, name, label in targets:
            setattr(obj, name, self._timed(getattr(obj, name), label))
        try:
            yield
        finally:
            for obj, name, fn in saved:
                setattr(obj, name, fn)

    def _timed(self, fn: Any, label: str) -> Any:
        def timed(*a: Any, **k: Any) -> Any:
            if not self._on:
                return fn(*a, **k)
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = (time.perf_counter() - t) * 1e3
                if label == "forward":
                    self.forward_ms += dt
                else:
                    self.ms[label] += dt

        return timed

    @contextmanager
    def step(self, kind: str) -> Iterator[None]:
        self._on = kind == "decode"
        t = time.perf_counter()
        try:
            yield
        finally:
            if self._on:
                self.steps += 1
                self.step_ms += (time.perf_counter() - t) * 1e3
            self._on = False

    def per_step(self) -> dict[str, float]:
        n = max(1, self.steps)
        out = {p: self.ms[p] / n for p in PIECES}
        rest = "other work of the forward (embedding, residuals, reshapes, logits buffer)"
        out[rest] = (self.forward_ms - sum(self.ms.values())) / n
        outside = "outside the forward (layout, dense-copy plan, sampling, post-processing)"
        out[outside] = (self.step_ms - self.forward_ms) / n
        out["step"] = self.step_ms / n
        return out


def measure(widths: tuple[int, ...], repeats: int, max_tokens: int) -> dict[str, Any]:
    import os

    from batchmlx.config import THREADS_ENV as ENV
    from benchmarks.peers.models import default_gguf
    from benchmarks.width import load

    loaded = load(dtype="auto")  # what a user gets
    threads = int(os.environ.get(ENV) or 2)
    ov = OVWorker(Path(default_gguf()), threads)
    prompts = Prompts(loaded.tokenizer)
    res: dict[str, Any] = {"runs": {s: defaultdict(list) for s in SYSTEMS}, "pieces": {},
                           "load_start": load_now(), "busy_start": cpu_busy(),
                           "threads": threads, "ov_version": ov.version}  # fmt: skip
    try:
        for w in widths:  # warm-up: oneDNN's primitives, OpenVINO's pipelines
            log(f"warm-up at width {w}")
            bmx_run(loaded, w, True, prompts.take(w), 4)
            bmx_run(loaded, w, False, prompts.take(w), 4)
            ov.ask(cmd="steps", width=w, budget=2048, prompts=prompts.take(w), max_tokens=4)
        for rep in range(repeats):
            for w in widths:
                ps = prompts.take(w)
                order = SYSTEMS[rep % 3 :] + SYSTEMS[: rep % 3]
                for who in order:
                    if who == "ov":
                        ans = ov.ask(cmd="steps", width=w, budget=2048, prompts=ps,
                                     max_tokens=max_tokens)  # fmt: skip
                        f = figures(ans["steps"], w)
                    else:
                        f = bmx_figures(bmx_run(loaded, w, who == "host", ps, max_tokens), w)
                    res["runs"][who][w].append(f)
                got = {s: res["runs"][s][w][-1] for s in SYSTEMS}
                log(f"rep {rep} width {w}: decode step " + ", ".join(
                    f"{s} {got[s].decode_ms:.1f} ms" for s in SYSTEMS))  # fmt: skip
        for w in widths:
            pieces = Pieces()
            with pieces.patched():
                bmx_run(loaded, w, True, prompts.take(w), max_tokens, pieces.step)
            res["pieces"][w] = pieces.per_step()
            log(f"pieces at width {w}: {res['pieces'][w]}")
    finally:
        ov.close()
    res["load_end"], res["busy_end"] = load_now(), cpu_busy()
    return res


def _med(fs: list[RunFigures], attr: str) -> float:
    return statistics.median(getattr(f, attr) for f in fs)


def report(res: dict[str, Any], widths: tuple[int, ...], repeats: int) -> str:
    runs = res["runs"]
    lines = [
        "# Host steps beside the MLX path and OpenVINO GenAI, and where a host step's time goes",
        "",
        f"`python -m benchmarks.host_steps` ({time.strftime('%Y-%m-%d %H:%M')} UTC). "
        f"{res['threads']} compute threads; load average {res['load_start']} at the start, "
        f"{res['load_end']} at the end; CPUs busy with others' work just before "
        f"{res['busy_start']:.0%}, just after {res['busy_end']:.0%}. The default model "
        "(SmolLM2-135M-Instruct) with `--dtype auto` (bf16 weights, oneDNN GEMMs); OpenVINO "
        f"GenAI {res['ov_version']} on the Q4_1 GGUF (bf16 activations). W questions at once, "
        f"greedy, 32 new tokens, max_batch_size W; {repeats} repeat(s), order rotated; "
        "medians. A decode step: every one of the W requests already had a token.",
        "",
        "| W | "
        + " | ".join(f"{LABELS[s]}: decode step ms" for s in SYSTEMS)
        + " | host / MLX path | host / OpenVINO | prefill phase ms: host / MLX / OpenVINO |",
        "|---|---|---|---|---|---|---|",
    ]
    for w in widths:
        d = {s: _med(runs[s][w], "decode_ms") for s in SYSTEMS}
        p = {s: _med(runs[s][w], "prefill_ms") for s in SYSTEMS}
        lines.append(f"| {w} | " + " | ".join(f"{d[s]:.1f}" for s in SYSTEMS)
                     + f" | {d['host'] / d['mlx']:.2f}x | {d['host'] / d['ov']:.2f}x | "
                     + " / ".join(f"{p[s]:.0f}" for s in SYSTEMS) + " |")  # fmt: skip
    lines += ["", "Where a host decode step goes (a separate pass, ms per step):", "",
              "| ms per step | " + " | ".join(f"W={w}" for w in widths) + " |",
              "|---|" + "---|" * len(widths)]  # fmt: skip
    rows = list(next(iter(res["pieces"].values())).keys())
    for row in rows:
        cells = " | ".join(f"{res['pieces'][w][row]:.1f}" for w in widths)
        lines.append(f"| {'**step**' if row == 'step' else row} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.host_steps", description=__doc__)
    p.add_argument("--quick", action="store_true", help="widths 8 and 64, 8 tokens, 1 repeat")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    if argv is None:
        from benchmarks.common import fast_blas

        fast_blas()  # re-executes this command line once, before any timing
    widths = QUICK_WIDTHS if args.quick else WIDTHS
    repeats, tokens = (1, 8) if args.quick else (3, 32)
    text = report(measure(widths, repeats, tokens), widths, repeats)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
