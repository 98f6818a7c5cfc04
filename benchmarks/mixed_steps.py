"""Mixed steps: long prompts arriving while many sequences decode, mixing on and off.

    python -m benchmarks.mixed_steps [--quick] [--out PATH]

Workload: `decoders` short chat requests start together and decode; while they run, `longs`
prompts of about `long_tokens` tokens arrive, one every `every` engine steps (arrivals are by
step number, so both modes see the same arrival schedule). Measured per mode, in one process,
alternating mixing on / off (`EngineSettings.mixed_steps`), after a warm-up:
- tok/s = generated tokens / wall time from the first submission to the last token;
- TTFT p50 / max of the long prompts (from their add() to their first token) and of all;
- stall = the longest wall gap between two consecutive tokens of one running sequence (from
  the streaming callback): with mixing off it is a whole prefill step of a long prompt; also in
  steps (deterministic: 1 means a token every step);
- CPU s = this process's CPU time for the run, steadier than wall time on a shared machine.
`section(loaded, quick)` returns the Markdown lines; `main()` prints them (and writes --out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import workloads as wl


@dataclass(frozen=True, slots=True)
class Workload:
    decoders: int = 24  # short requests decoding when the long prompts arrive
    decode_tokens: int = 96  # new tokens of each short request
    longs: int = 4  # long prompts arriving mid-decode
    long_tokens: int = 1000  # about, each
    long_new_tokens: int = 16
    first_arrival: int = 4  # engine step of the first long arrival
    every: int = 8  # steps between long arrivals
    max_batch_size: int = 32
    max_prefill_tokens: int = 512  # per-step token budget: a 1000-token prompt takes 2+ steps
    rounds: int = 2


FULL = Workload()
QUICK = Workload(decoders=8, decode_tokens=24, longs=2, long_tokens=300, long_new_tokens=4,
                 first_arrival=3, every=4, max_batch_size=16, max_prefill_tokens=128,
                 rounds=1)  # fmt: skip


@dataclass(slots=True)
class Run:
    mixed: bool
    wall_s: float
    tokens: int
    ttft_long: list[float]
    ttft_all: list[float]
    stall_s: float  # longest gap between two tokens of one sequence
    stall_steps: int  # the same in engine steps
    cpu_s: float
    steps: int
    mixed_steps: int
    same_tokens: bool = True

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


def long_prompt(tok: Any, i: int, target: int) -> list[int]:
    """About `target` tokens of whole sentences, rotated by i so no two share a first block
    after the template's."""
    sents = wl._SYSTEM_SENTENCES
    parts, k = [f"Document {i}."], i
    while len(tok.encode(" ".join(parts))) < target:
        parts.append(sents[k % len(sents)])
        k += 1
    return wl.chat_prompt(tok, " ".join(parts) + " Summarise the document in one line.")


def requests(loaded: Any, w: Workload, tag: str) -> list[tuple[int, Any]]:
    """(arrival step, request): the decoders at step 0, then the long prompts."""
    from batchmlx.core.request import GenerationRequest, SamplingParams

    tok = loaded.tokenizer
    short = SamplingParams(max_tokens=w.decode_tokens, temperature=0.0)
    long = SamplingParams(max_tokens=w.long_new_tokens, temperature=0.0)
    out = [
        (0, GenerationRequest(f"{tag}d{i}", p, short))  # no eos: every one runs to max_tokens
        for i, p in enumerate(wl.unique_prompts(tok, w.decoders))
    ]
    out += [
        (w.first_arrival + i * w.every,
         GenerationRequest(f"{tag}l{i}", long_prompt(tok, i, w.long_tokens), long))
        for i in range(w.longs)
    ]  # fmt: skip
    return out


def run(loaded: Any, w: Workload, mixed: bool, tag: str) -> tuple[Run, dict[str, list[int]]]:
    from batchmlx.core.engine_api import EngineSettings
    from batchmlx.engine.runners.paged import paged_engine

    cfg = EngineSettings(
        max_batch_size=w.max_batch_size, max_prefill_tokens=w.max_prefill_tokens,
        mixed_steps=mixed,
    )  # fmt: skip
    engine = paged_engine(loaded.model, loaded.tokenizer, context_length=loaded.context_length,
                    config=cfg, seed=0)  # fmt: skip
    last: dict[str, tuple[float, int]] = {}
    stall, stall_steps = 0.0, 0

    def on_token(rid: str, _tok: int) -> None:
        nonlocal stall, stall_steps
        now, step = time.perf_counter(), engine.runner.stats.steps
        if rid in last:
            stall = max(stall, now - last[rid][0])
            stall_steps = max(stall_steps, step - last[rid][1])
        last[rid] = (now, step)

    engine.on_token = on_token
    pending = requests(loaded, w, tag)
    outs: dict[str, Any] = {}
    n = 0
    t0, c0 = time.perf_counter(), time.process_time()
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= n:
            engine.add(pending.pop(0)[1])
        for o in engine.step():
            outs[o.request_id] = o
        n += 1
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    longs = [o.first_token_s for rid, o in outs.items() if rid.startswith(f"{tag}l")]
    result = Run(
        mixed=mixed, wall_s=wall, tokens=sum(len(o.token_ids) for o in outs.values()),
        ttft_long=longs, ttft_all=[o.first_token_s for o in outs.values()], stall_s=stall,
        stall_steps=stall_steps, cpu_s=cpu, steps=engine.runner.stats.steps,
        mixed_steps=engine.runner.stats.mixed_steps,
    )  # fmt: skip
    return result, {rid[len(tag) :]: o.token_ids for rid, o in outs.items()}


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:,.0f} / {max(xs) * 1e3:,.0f}"


def section(loaded: Any, quick: bool = False, workload: Workload | None = None) -> list[str]:
    w = workload or (QUICK if quick else FULL)
    warm = Workload(decoders=2, decode_tokens=4, longs=1, long_tokens=64, long_new_tokens=2,
                    first_arrival=1, every=1, max_prefill_tokens=32, rounds=1)  # fmt: skip
    for mixed in (True, False):
        run(loaded, warm, mixed, "w")
    runs: list[Run] = []
    for r in range(w.rounds):
        # the first big run of a process also pays for memory the allocator later reuses: the
        # order alternates between rounds so that cost does not always land on one mode
        first = r % 2 == 0
        a, a_tokens = run(loaded, w, first, f"a{r}")
        b, b_tokens = run(loaded, w, not first, f"b{r}")
        a.same_tokens = b.same_tokens = a_tokens == b_tokens
        runs += [a, b] if first else [b, a]
    lines = [
        "## Mixed steps: decodes never wait for a prefill",
        "",
        f"`python -m benchmarks.mixed_steps{' --quick' if quick else ''}` — {w.decoders} "
        f"short requests decode {w.decode_tokens} tokens each; {w.longs} prompts of about "
        f"{w.long_tokens} tokens ({w.long_new_tokens} new tokens each) arrive at steps "
        f"{w.first_arrival}, {w.first_arrival + w.every}, ...; max batch {w.max_batch_size}, "
        f"step token budget {w.max_prefill_tokens}, greedy. Mixing on: decodes and prompt "
        "chunks share each step (packed, no padding); off: a step is all prefill or all decode.",
        "",
        "| mixing | round | tok/s | CPU s | TTFT long p50 / max ms | TTFT all p50 / max ms | "
        "longest stall ms (steps) | steps (mixed) | same tokens |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(runs):
        lines.append(
            f"| {'on' if r.mixed else 'off'} | {i // 2 + 1} | {r.tok_s:.1f} | {r.cpu_s:.1f} | "
            f"{_ms(r.ttft_long)} | {_ms(r.ttft_all)} | {r.stall_s * 1e3:,.0f} "
            f"({r.stall_steps}) | "
            f"{r.steps} ({r.mixed_steps}) | {'yes' if r.same_tokens else 'NO'} |"
        )
    on, off = runs[-2], runs[-1]
    lines += [
        "",
        f"Round {w.rounds} (rounds alternate which mode runs first), on / off: throughput "
        f"**{on.tok_s / off.tok_s:.2f}x** (CPU time "
        f"{on.cpu_s / off.cpu_s:.2f}x), longest stall "
        f"**{on.stall_s / off.stall_s:.2f}x**, long-prompt TTFT p50 "
        f"{statistics.median(on.ttft_long) / statistics.median(off.ttft_long):.2f}x. "
        f"Load average {os.getloadavg()[0]:.1f} (a shared machine skews wall times).",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--out", type=Path, help="also write the Markdown here")
    args = ap.parse_args(argv)
    from batchmlx.engine.host.fast_blas import ensure_fast_blas

    ensure_fast_blas()  # re-executes once onto the fast BLAS, as every batchmlx command does
    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import load_model

    cache = Path(os.environ.get("BATCHMLX_CACHE_DIR", Path.home() / ".cache" / "batchmlx-test"))
    loaded = load_model(resolve_model("default", cache_dir=cache), cache_dir=cache)
    text = "\n".join(section(loaded, args.quick))
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
