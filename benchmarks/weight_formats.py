"""The engine's tok/s with each weight format, side by side in one process: float32 (the
default on a CPU) against `--dtype int8` (kernels/int8_linear.py, needs batchmlx[cpu-int8]).

At each width W, W unique chats are generated greedily (`--max-tokens` each, prefill
included) through the paged engine; the formats alternate, `--reps` times, medians kept. Also
the memory the weights hold in each format.

    eval "$(python -m batchmlx.engine.host.fast_blas --exports)"
    python -m benchmarks.weight_formats --widths 8,64,128 --max-tokens 32 --reps 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

TOPICS = ["the sea", "a library", "prime numbers", "the moon", "a CPU", "bread", "rain", "trains",
          "chess", "music", "winter", "bees", "maps", "glass", "rivers", "clocks"]  # fmt: skip


def chats(tok, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        msg = f"Write {2 + i % 5} short sentences about {TOPICS[i % len(TOPICS)]} (note {i})."
        text = tok.apply_chat_template([{"role": "user", "content": msg}],
                                       add_generation_prompt=True, tokenize=False)  # fmt: skip
        out.append(list(tok.encode(text, add_special_tokens=False)))
    return out


def weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def run(loaded, prompts, width: int, max_tokens: int) -> tuple[float, int]:
    from batchmlx.core.engine_api import EngineSettings
    from batchmlx.core.request import GenerationRequest, SamplingParams
    from batchmlx.engine.runners.paged import paged_engine

    engine = paged_engine(loaded.model, loaded.tokenizer, context_length=loaded.context_length,
                    config=EngineSettings(max_batch_size=width), seed=0)  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    reqs = [GenerationRequest(f"r{i}", p, params, frozenset()) for i, p in enumerate(prompts)]
    t0 = time.perf_counter()
    outs = engine.generate(reqs)
    wall = time.perf_counter() - t0
    return wall, sum(len(o.token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--widths", default="8,64,128")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--formats", default="float32,int8")
    a = ap.parse_args()
    from batchmlx.config import load_settings
    from batchmlx.core.models import resolve_model
    from batchmlx.engine.models.loader import load_model

    cache = Path(load_settings().cache_dir)
    spec = resolve_model(a.model, cache_dir=cache)
    formats = a.formats.split(",")
    loaded = {f: load_model(spec, cache_dir=cache, dtype=f) for f in formats}
    widths = [int(w) for w in a.widths.split(",")]
    prompts = chats(loaded[formats[0]].tokenizer, max(widths))
    print(f"# {spec.name}, {a.max_tokens} new tokens a request (no EOS stop), load "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus", flush=True)  # fmt: skip
    tps: dict[tuple[str, int], list[float]] = {}
    for w in widths:
        for f in formats:  # warm: primitives, KV arrays
            run(loaded[f], prompts[: min(w, 8)], w, 4)
        for _ in range(a.reps):
            for f in formats:
                wall, toks = run(loaded[f], prompts[:w], w, a.max_tokens)
                tps.setdefault((f, w), []).append(toks / wall)
        print(f"# width {w} done, load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"\ntok/s (generated tokens / wall time, prefill included; median of {a.reps})")
    print("| weights | weight memory | " + " | ".join(f"width {w}" for w in widths) + " |")
    print("|---|---|" + "---|" * len(widths))
    for f in formats:
        cells = [f"{statistics.median(tps[(f, w)]):.1f}" for w in widths]
        mb = weight_bytes(loaded[f].model) / 2**20
        print(f"| {f} | {mb:.0f} MB | " + " | ".join(cells) + " |")
    if len(formats) == 2:
        ratio = [statistics.median(tps[(formats[1], w)]) / statistics.median(tps[(formats[0], w)])
                 for w in widths]  # fmt: skip
        print(f"| {formats[1]} / {formats[0]} | | " + " | ".join(f"{r:.2f}x" for r in ratio)
              + " |")  # fmt: skip


if __name__ == "__main__":
    main()
