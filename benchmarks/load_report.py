"""The report of `python -m benchmarks.load_serve`: the targets, met or not, and the markdown
page (benchmarks/RESULTS-load.md) from one run's `Outcome`."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from benchmarks.load_plan import (
    MAX_TARGET_S,
    P99_TARGET_S,
    POLLERS,
    RSS_FLAT_PCT,
    SLOW_S,
    Outcome,
    _pct,
)


@dataclass(frozen=True)
class Target:
    name: str
    measured: str
    met: bool
    hard: bool  # enforced by --quick


def _ms(s: float) -> str:
    return "n/a" if s != s else f"{s * 1000:.0f} ms" if s >= 0.01 else f"{s * 1000:.1f} ms"


def rss_flat(rss: list[tuple[float, int]]) -> tuple[float, float, float] | None:
    """(middle third's median MB, last third's median MB, % change): the first third is warm-up."""
    if len(rss) < 6:
        return None
    end = rss[-1][0]
    mid = [b for t, b in rss if end / 3 <= t < 2 * end / 3]
    last = [b for t, b in rss if t >= 2 * end / 3]
    if not mid or not last:
        return None
    m, la = statistics.median(mid) / 2**20, statistics.median(last) / 2**20
    return m, la, (la - m) / m * 100


def targets(o: Outcome) -> list[Target]:
    rec, n = o.rec, o.plan.batch
    out = []
    for p in POLLERS:
        xs = rec.latency.get(p.name, [])
        out.append(Target(f"{p.name} p99 < {_ms(P99_TARGET_S)}", _ms(_pct(xs, 99)),
                          bool(xs) and _pct(xs, 99) < P99_TARGET_S, False))  # fmt: skip
        top = max(xs, default=float("nan"))
        out.append(Target(f"{p.name} max < {MAX_TARGET_S:.0f} s", _ms(top),
                          bool(xs) and max(xs) < MAX_TARGET_S, False))  # fmt: skip
    kinds = Counter(f"{f.what}: {f.kind}" for f in rec.failures)
    failed = (o.batch.get("request_counts") or {}).get("failed", 0)
    err = ", ".join(f"{k} x{v}" for k, v in kinds.most_common(4)) or "none"
    out.append(Target("zero errors (non-2xx, exceptions, timeouts; failed batch rows)",
                      f"{len(rec.failures)} ({err}); failed rows {failed}",
                      not rec.failures and not failed, True))  # fmt: skip
    expected = {f"req-{i}" for i in range(n)}
    lost, dup = expected - set(o.ids), [k for k, v in o.ids.items() if v > 1]
    extra = set(o.ids) - expected
    out.append(Target(f"nothing lost or duplicated ({n} custom_ids, each once)",
                      f"{len(set(o.ids) & expected)} distinct; lost {len(lost)}, duplicated "
                      f"{len(dup)}, unknown {len(extra)}",
                      not lost and not dup and not extra, True))  # fmt: skip
    out.append(Target("no traceback in the server log", f"{len(o.tracebacks)}",
                      not o.tracebacks, True))  # fmt: skip
    flat = rss_flat(rec.rss)
    out.append(Target(f"memory flat after warm-up (last third's median RSS within "
                      f"{RSS_FLAT_PCT:.0f}% of the middle third's)",
                      "n/a" if flat is None
                      else f"{flat[0]:.0f} → {flat[1]:.0f} MB ({flat[2]:+.1f}%)",
                      flat is not None and flat[2] <= RSS_FLAT_PCT, False))  # fmt: skip
    return out


def _machine() -> str:
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{os.cpu_count()} CPUs, load average (1/5/15 min) {load}"


def _commit() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).parent,
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "batchmlx"],
                               capture_output=True, text=True, timeout=10,
                               cwd=Path(__file__).parent).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return rev + (" (batchmlx/ modified)" if dirty else "")


def report(o: Outcome, *, quick: bool, database: str, machine_start: str, wall_s: float) -> str:
    rec, plan = o.rec, o.plan
    tg = targets(o)
    lines = [
        f"# Load test of `batchmlx serve` (`python -m benchmarks.load_serve{' --quick' * quick}`)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {_commit()}, database "
        f"{database}, model `default`. Machine: at start {machine_start}; at end {_machine()} "
        "(shared with other processes, as it was).",
        "",
        f"Load: a {plan.batch}-request chat batch (max_tokens {plan.batch_max_tokens}) through "
        f"the Files and Batches APIs; {plan.streams} concurrent streamed chats (max_tokens "
        f"{plan.stream_max_tokens}, up to {plan.rounds} rounds each, {plan.stream_gap_s:g} s "
        f"apart, while the batch runs); one embeddings request of {plan.embed_inputs} inputs "
        f"{plan.embed_after_s:g} s in; pollers at a fixed rate, open-loop (a polled request "
        f"unanswered after {plan.control_timeout_s:g} s is a timeout error). Server ready in "
        f"{o.ready_s:.1f} s; batch created → {o.batch.get('status')} in {o.batch_wall_s:.1f} s; "
        f"the whole run {wall_s:.0f} s.",
        "",
        "| target | measured | met |",
        "|---|---|---|",
        *(f"| {t.name} | {t.measured} | {'met' if t.met else '**not met**'} |" for t in tg),
        "",
        "| control endpoint | rate | answered | p50 | p99 | max | skipped slots |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in POLLERS:
        xs = rec.latency.get(p.name, [])
        lines.append(f"| {p.name} | {p.hz:g}/s | {len(xs)} | {_ms(_pct(xs, 50))} | "
                     f"{_ms(_pct(xs, 99))} | {_ms(max(xs, default=float('nan')))} | "
                     f"{rec.skipped[p.name]} |")  # fmt: skip
    lines += [
        "",
        "| streams | requests done | tokens | TTFT p50 | TTFT p99 | TTFT max | inter-token p50 "
        "| inter-token p99 | inter-token max |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {plan.streams} | {rec.stream_requests} | {rec.stream_tokens} | "
        f"{_ms(_pct(rec.ttft, 50))} | {_ms(_pct(rec.ttft, 99))} | "
        f"{_ms(max(rec.ttft, default=float('nan')))} | {_ms(_pct(rec.itl, 50))} | "
        f"{_ms(_pct(rec.itl, 99))} | {_ms(max(rec.itl, default=float('nan')))} |",
        "",
        f"Embeddings request ({plan.embed_inputs} inputs): "
        + ("no answer" if rec.embed_s is None else f"answered in {rec.embed_s:.1f} s")
        + ".",
        f"Batch rows: {o.output_rows} in the output file, {o.error_rows} in the error file; "
        f"request_counts {json.dumps(o.batch.get('request_counts'))}.",
        f"Server stop (SIGTERM): exited after {o.stop_s:.1f} s, code {o.stop_code} "
        f"({'graceful: the log says the shutdown completed' if o.graceful else 'NOT graceful'}"
        "; uvicorn re-raises the SIGTERM it caught, hence -15).",
        "",
        *_rss_lines(rec.rss, rec.mlx),
    ]
    if rec.slow:
        rec.slow.sort()
        lines += [
            "",
            f"Control requests slower than {SLOW_S * 1000:.0f} ms (sent at, since "
            "the load started; the first 20): "
            + "; ".join(f"{at:.1f} s {what} {_ms(dt)}" for at, what, dt in rec.slow[:20])
            + ".",
        ]
    if rec.failures:
        lines += ["", "Errors (the first 20):", ""]
        lines += [f"- {f.at_s:.1f} s, {f.what}: {f.kind}: {f.detail}" for f in rec.failures[:20]]
    if o.tracebacks:
        lines += ["", "Tracebacks in the server log (the line after each):", ""]
        lines += [f"- `{t.strip()}`" for t in o.tracebacks[:10]]
    return "\n".join(lines) + "\n"


def _rss_lines(rss: list[tuple[float, int]],
               mlx: list[tuple[float, dict[str, float]]] = ()) -> list[str]:  # fmt: skip
    if not rss:
        return ["RSS: no samples."]
    step = max(1, len(rss) // 12)
    pts = rss[::step] + ([rss[-1]] if (len(rss) - 1) % step else [])
    peak = max(b for _, b in rss) / 2**20
    lines = [
        f"RSS of the serve process (MB; {len(rss)} samples, peak {peak:.0f}), and MLX's "
        "active and cached memory from the nearest /metrics scrape (MB):",
        "",
        "| s | " + " | ".join(f"{t:.0f}" for t, _ in pts) + " |",
        "|---|" + "---|" * len(pts),
        "| RSS | " + " | ".join(f"{b / 2**20:.0f}" for _, b in pts) + " |",
    ]
    for kind in ("active", "cache") if mlx else ():
        near = [min(mlx, key=lambda m, t=t: abs(m[0] - t))[1].get(kind) for t, _ in pts]
        lines.append(
            f"| MLX {kind} | "
            + " | ".join("?" if v is None else f"{v / 2**20:.0f}" for v in near)
            + " |"
        )
    return lines


def _database_name(url: str | None) -> str:
    if not url:
        return "SQLite (fresh $BATCHMLX_HOME)"
    return urlsplit(url).scheme.split("+")[0] or "?"  # never the URL itself: it may hold a password
