"""Section 12 of `benchmarks.run`: batchmlx beside its CPU peers (llama.cpp's server, OpenVINO
GenAI, vLLM CPU), every system a whole process timed from spawn to results (load included),
with its steady-state tok/s (load excluded), peak RSS and the precision it computes in.

Cases: the default model (SmolLM2-135M) on the unique and shared workloads of whole_process.py;
random-weight models of SmolLM2-360M's and -1.7B's shapes (8 chats x 32 new tokens, no EOS) at
each system's 8- and 4-bit formats, and of Qwen3-1.7B's and Gemma-3-1B's (the peers at Q8_0 and
Q4_K_M, what most people download); an 8B llama shape (4 chats x 16 tokens) for memory.
`--models default,qwen3-1.7b` measures only those models' cases. A peer
whose set-up is missing is built on first use (benchmarks/peers/setup.py: minutes; never in
CI); one that fails is reported as failed and the others go on.

    python -m benchmarks.run --sections 12            # or: python -m benchmarks.peers.section
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks.peers.run_peer import PeerRun, run, same_texts, workload
from benchmarks.whole_process import Workload

CHATS = Workload("chats", 8, 32, None)  # the random shapes: 8 chats, 32 new tokens each
CHATS_8B = Workload("chats", 4, 16, None)
FAMILY_QUANTS = ("Q8_0", "Q4_K_M")  # the Qwen3 and Gemma 3 shapes' GGUFs (issue 48)


@dataclass(frozen=True)
class System:
    peer: str  # batchmlx | llama | openvino | vllm
    options: dict[str, Any] = field(default_factory=dict)  # e.g. {"quant": "Q8_0"}


@dataclass(frozen=True)
class Case:
    model: str  # default | 360m | 1.7b | qwen3-1.7b | gemma3-1b | 8b
    workload: Workload
    systems: tuple[System, ...]
    rounds: int = 1  # each system this many times, the systems alternated (see `measure`)


# the default model's cases run each system three times, in turn: their runs take 8-60 s, and
# this machine's speed moved by a quarter within minutes (the same batchmlx run gave 628-664
# tok/s, then 502 ten minutes later), so one run each compared systems at different speeds
DEFAULT_ROUNDS = 3
# a system whose run takes longer runs once: its run spans those swings itself (llama.cpp's
# server on the shared prompt: ~250 s)
LONG_RUN_S = 120.0


# the default is int8 where its kernel runs (AVX-512 VNNI), so the other row is bf16
BMX, BMX_BF16, BMX_F32 = System("batchmlx"), System("batchmlx", {"dtype": "bfloat16"}), System(
    "batchmlx", {"dtype": "float32"})  # fmt: skip


def _quants(peer: str, quants: tuple[str, ...] = ("Q8_0", "Q4_0")) -> tuple[System, ...]:
    return tuple(System(peer, {"quant": q}) for q in quants)


def cases(quick: bool = False) -> list[Case]:
    unique, shared = workload("unique", quick=quick), workload("shared", quick=quick)
    peers = (System("llama"), System("openvino"), System("vllm"))
    shapes = (*_quants("llama"), *_quants("openvino"))
    chats = Workload("chats", 4, 8, None) if quick else CHATS
    rounds = 1 if quick else DEFAULT_ROUNDS
    out = [Case("default", unique, (BMX, BMX_F32, *peers), rounds),
           Case("default", shared, (BMX, *peers), rounds),
           Case("360m", chats, (BMX, BMX_BF16, *shapes)),
           Case("1.7b", chats, (BMX, BMX_BF16, *shapes))]  # fmt: skip
    families = (*_quants("llama", FAMILY_QUANTS), *_quants("openvino", FAMILY_QUANTS))
    # batchmlx on the Q4_K_M file in its own bits (--dtype q4) beside its default on the folder
    q4 = System("batchmlx", {"dtype": "q4", "quant": "Q4_K_M"})
    out += [Case(m, chats, (BMX, q4, *families)) for m in ("qwen3-1.7b", "gemma3-1b")]
    if not quick:
        out.append(Case("8b", CHATS_8B, (BMX, System("llama", {"quant": "Q4_0"}))))
    return out


def _log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


# (model, options) of the batchmlx systems already run once in this process
_warm: set[tuple[str, str]] = set()


def measure(case: Case, runner: Callable[..., PeerRun] = run) -> list[PeerRun | str]:
    """Each system of `case` `case.rounds` times (once where its run took over LONG_RUN_S),
    the systems in turn each round; a failure is its message, not the end. Of several runs a
    system's row is its median one (`median`).
    A batchmlx system's first run of a model in this process is preceded by an untimed
    one-request run: on a fresh machine its first load converts and packs the weights into the
    cache (24 s of a 30 s run at 1.7B int8), which the README's figures exclude ("after the
    first run") and the peers' GGUFs, made before their runs, never pay."""
    runs: list[list[PeerRun | str]] = [[] for _ in case.systems]
    for r in range(max(1, case.rounds)):
        for i, s in enumerate(case.systems):
            if any(isinstance(x, str) for x in runs[i]):
                continue  # failed once: not again
            if any(isinstance(x, PeerRun) and x.wall_s > LONG_RUN_S for x in runs[i]):
                continue
            key = (case.model, repr(sorted(s.options.items())))
            if s.peer == "batchmlx" and key not in _warm:
                _warm.add(key)
                _log(f"{case.model}: warm-up run of batchmlx {s.options} (untimed)")
                try:
                    runner(s.peer, replace(case.workload, requests=1, max_tokens=2), case.model,
                           **s.options)  # fmt: skip
                except Exception as exc:  # the timed run will fail and say why
                    _log(f"  warm-up failed: {exc}")
            round_note = f", round {r + 1} of {case.rounds}" if case.rounds > 1 else ""
            _log(f"{case.model} {case.workload.name}: {s.peer} {s.options} (load "
                 f"{os.getloadavg()[0]:.1f}{round_note})")  # fmt: skip
            t = time.perf_counter()
            try:
                got = runner(s.peer, case.workload, case.model, **s.options)
            except Exception as exc:  # one peer failing must not stop the others
                _log(f"  FAILED after {time.perf_counter() - t:.0f} s: {exc}")
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                runs[i].append(f"{s.peer} {s.options}: failed: {first[:200]}".replace("|", "/"))
                continue
            _log("  " + got.summary())
            runs[i].append(got)
    out: list[PeerRun | str] = []
    for tried in runs:
        failed = [x for x in tried if isinstance(x, str)]
        out.append(failed[0] if failed else median([x for x in tried if isinstance(x, PeerRun)]))
    return out


def median(runs: list[PeerRun]) -> PeerRun:
    """One system's row of several runs: the run of median whole-process time (its tok/s,
    load and texts), with the median of their steady tok/s and the highest peak RSS; `extra`
    keeps every run's figures. One run: itself."""
    if len(runs) == 1:
        return runs[0]
    mid = sorted(runs, key=lambda r: r.wall_s)[(len(runs) - 1) // 2]
    every = [{"wall_s": round(r.wall_s, 2), "tok_s": round(r.tok_s, 1),
              "steady_tok_s": round(r.steady_tok_s, 1), "peak_rss_mb": round(r.peak_rss_mb)}
             for r in runs]  # fmt: skip
    return replace(mid, steady_tok_s=statistics.median(r.steady_tok_s for r in runs),
                   peak_rss_mb=max(r.peak_rss_mb for r in runs),
                   extra={**mid.extra, "rounds": every})  # fmt: skip


def _label(r: PeerRun) -> str:
    return r.system + (f" {r.extra['gguf'].split('.')[-2]}" if "gguf" in r.extra and
                       r.model != "default" else "")  # fmt: skip


def table(case: Case, runs: list[PeerRun | str]) -> list[str]:
    wl = case.workload
    what = (f"{wl.requests} requests x {'up to ' if case.model == 'default' else ''}"
            f"{wl.max_tokens} new tokens" + (f", ~{wl.system_tokens}-token shared system prompt"
                                             if wl.system_tokens else ""))  # fmt: skip
    lines = [f"**{case.model}, {wl.name}** ({what})", "",
             "| system | computes in | whole process s | tok/s | load s | steady tok/s | "
             "peak RSS MB | batchmlx (defaults) / it, tok/s | same texts as batchmlx |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    ok = [r for r in runs if isinstance(r, PeerRun)]
    ref = next((r for r in ok if r.system == "batchmlx (defaults)"), None)
    for r in ok:
        ratio = f"{ref.tok_s / r.tok_s:.2f}x" if ref and r.tok_s else "n/a"
        same = same_texts(ref.texts, r.texts) if ref and r is not ref else ""
        lines.append(f"| {_label(r)} | {r.precision} | {r.wall_s:.1f} | {r.tok_s:.1f} | "
                     f"{r.load_s:.1f} | {r.steady_tok_s:.1f} | {r.peak_rss_mb:,.0f} | {ratio} | "
                     f"{same} |")  # fmt: skip
    lines += [f"| {r} |" + " |" * 8 for r in runs if isinstance(r, str)]
    if case.rounds > 1:
        lines += [
            "",
            f"Each system {case.rounds} times (once where a run took over {LONG_RUN_S:.0f} s), "
            "the systems in turn each round; a row is the run of median whole-process time, "
            "with the median steady tok/s and the highest peak RSS of its runs. Every run, "
            "whole process s / steady tok/s:",
            "",
        ]
        for r in ok:
            every = r.extra.get("rounds", [])
            runs_text = ", ".join(f"{x['wall_s']:.1f} s / {x['steady_tok_s']:.0f}" for x in every)
            once = f"{r.wall_s:.1f} s / {r.steady_tok_s:.0f} (once)"
            lines.append(f"- {_label(r)}: {runs_text or once}")
    return [*lines, ""]


def best(runs: list[PeerRun | str], peer: str, key: str = "tok_s") -> PeerRun | None:
    mine = [r for r in runs if isinstance(r, PeerRun) and r.peer == peer]
    return max(mine, key=lambda r: getattr(r, key), default=None)


def run_all(quick: bool = False, out_json: Path | None = None,
            without: frozenset[str] = frozenset(),
            models: tuple[str, ...] = ()) -> dict[tuple[str, str], list]:  # fmt: skip
    """Every case (or those of `models`), each system in turn."""
    results: dict[tuple[str, str], list] = {}
    for c in cases(quick):
        if models and c.model not in models:
            continue
        kept = replace(c, systems=tuple(s for s in c.systems if s.peer not in without))
        results[(c.model, c.workload.name)] = measure(kept)
        if out_json is not None:  # after every case: a crash later keeps what was measured
            out_json.write_text(json.dumps(
                {f"{m} {w}": [asdict(r) if isinstance(r, PeerRun) else r for r in rs]
                 for (m, w), rs in results.items()}, indent=1))  # fmt: skip
    return results


def markdown(results: dict[tuple[str, str], list], quick: bool = False) -> list[str]:
    lines = ["Every system a fresh process timed from spawn to results in hand (load included); "
             "steady tok/s = completion tokens over the time from ready to the last token; peak "
             "RSS of the process tree (sampled every 0.2 s). Greedy; the random shapes run to "
             "max_tokens (no EOS). One run each, in turn, but where a case says otherwise.",
             ""]  # fmt: skip
    for c in cases(quick):
        if (c.model, c.workload.name) in results:
            lines += table(c, results[(c.model, c.workload.name)])
    return lines


def _ratio(a: PeerRun | None, b: PeerRun | None, key: str = "tok_s") -> float | None:
    if a is None or b is None or not getattr(b, key):
        return None
    return getattr(a, key) / getattr(b, key)


def _row(name: str, x: float | None, goal: float, lower: bool = False) -> tuple[str, str, bool]:
    if x is None:
        return (name, "not measured", False)
    return (name, f"{x:.2f}x", x <= goal if lower else x >= goal)


def _rss(r: PeerRun | None) -> str:
    return f"{r.peak_rss_mb:,.0f} MB" if r else "not measured"


def targets(results: dict[tuple[str, str], list]) -> list[tuple[str, str, bool]]:
    """Issues 47 and 48's targets, from one run's results (ratios of tok/s, whole process, and
    of steady tok/s where named; peak RSS of the process tree)."""
    uniq, shared = results.get(("default", "unique"), []), results.get(("default", "shared"), [])
    me = best(uniq, "batchmlx")
    out = [_row(">= 2.5x llama.cpp server, unique prompts at 135M",
                _ratio(me, best(uniq, "llama")), 2.5),
           _row(">= 1.25x OpenVINO GenAI, unique prompts at 135M",
                _ratio(me, best(uniq, "openvino")), 1.25),
           _row(">= 1.25x OpenVINO GenAI, unique prompts at 135M, steady state",
                _ratio(best(uniq, "batchmlx", "steady_tok_s"),
                       best(uniq, "openvino", "steady_tok_s"), "steady_tok_s"), 1.25)]  # fmt: skip
    mine = next((r for r in uniq if isinstance(r, PeerRun)
                 and r.system == "batchmlx (defaults)"), None)  # fmt: skip
    out.append(("peak RSS at 135M <= 850 MB, unique prompts (defaults)", _rss(mine),
                mine is not None and mine.peak_rss_mb <= 850))  # fmt: skip
    me = best(shared, "batchmlx")
    for peer, name, goal in (("llama", "llama.cpp server", 10), ("vllm", "vLLM CPU", 5),
                             ("openvino", "OpenVINO GenAI", 5)):  # fmt: skip
        out.append(_row(f">= {goal}x {name}, shared ~900-token prompt",
                        _ratio(me, best(shared, peer)), goal))  # fmt: skip
    for model, what in (("1.7b", "SmolLM2-1.7B"), ("qwen3-1.7b", "Qwen3-1.7B"),
                        ("gemma3-1b", "Gemma-3-1B")):  # fmt: skip
        out += _shape_targets(results.get((model, "chats"), []), what)
    huge = best(results.get(("8b", "chats"), []), "batchmlx")
    if ("8b", "chats") in results:
        out.append(("the 8B shape runs on this machine",
                    f"{huge.tok_s:.2f} tok/s, {huge.peak_rss_mb:,.0f} MB" if huge else "failed",
                    huge is not None))  # fmt: skip
    return out


def _shape_targets(runs: list[PeerRun | str], what: str) -> list[tuple[str, str, bool]]:
    """>= 1.5x the best peer's tok/s (whole process), and peak RSS <= 1.25x llama.cpp's Q8_0
    (batchmlx's default being 8-bit)."""
    if not runs:
        return []
    rival = max((r for r in (best(runs, "llama"), best(runs, "openvino")) if r),
                key=lambda r: r.tok_s, default=None)  # fmt: skip
    mine = best(runs, "batchmlx")
    q8 = next((r for r in runs if isinstance(r, PeerRun) and r.peer == "llama"
               and r.precision.startswith("Q8_0")), None)  # fmt: skip
    return [_row(f">= 1.5x the best of llama.cpp and OpenVINO GenAI, {what} shape",
                 _ratio(mine, rival), 1.5),
            _row(f"peak RSS <= 1.25x llama.cpp Q8_0's, {what} shape",
                 _ratio(mine, q8, "peak_rss_mb"), 1.25, lower=True)]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", type=Path, default=Path("/tmp/batchmlx-peers.json"))
    p.add_argument("--without", action="append", default=[], choices=["llama", "openvino", "vllm"],
                   help="leave this peer out (its rows then read as not measured)")  # fmt: skip
    p.add_argument("--models", default="", help="only these models' cases, comma-separated")
    a = p.parse_args(argv)
    models = tuple(m for m in a.models.split(",") if m)
    results = run_all(a.quick, a.json, frozenset(a.without), models)
    print("\n".join(markdown(results, a.quick)))
    for name, got, ok in targets(results):
        print(f"- {name}: {got} {'MET' if ok else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
