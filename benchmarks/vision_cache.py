"""Prefill saved by image reuse in the vision engine's prefix cache (engine/vision.py).

A random-weight LLaVA built from mlx-vlm's classes (tests/tiny_vlm.py, scaled up: a 336-pixel
image is 576 placeholder tokens, a 4-layer 512-wide language model, a 4-layer CLIP tower). Each
row is one greedy request of 1 new token (so the time is prefill), after a warm-up request:
- cold: a new image and question (the vision tower runs, every prompt token is computed);
- same image, other question: the image's blocks come from the cache, and the features of its
  last block (which holds question tokens too) from the engine's feature cache: no vision tower;
- same image and prompt: a HIT (all but the last block; no vision tower);
- other image, same question: only the system prompt's blocks are reused.
Times are the best and the median of `--repeats` runs (rows interleaved), each on a fresh engine
primed with image a and the first question.

    python -m benchmarks.vision_cache [--repeats 5] [--out benchmarks/RESULTS-vision.md]
"""

from __future__ import annotations

import argparse
import base64
import statistics
import tempfile
import time
from pathlib import Path

SYSTEM = "You are a careful assistant. Look at the picture and answer in one short sentence."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from batchmlx.engine.host.fast_blas import ensure_fast_blas

    ensure_fast_blas()  # re-executes once onto the fast BLAS, as every batchmlx command does
    from batchmlx.core.engine_api import EngineSettings
    from batchmlx.core.request import GenerationRequest, SamplingParams
    from batchmlx.engine.runners.vision import vision_engine
    from batchmlx.engine.vision.load import load_vision
    from batchmlx.engine.vision.prompter import VisionPrompter
    from batchmlx.formats.params import parse_request
    from tests.e2e.helpers import model_cache_dir
    from tests.tiny_vlm import build_tiny_vlm, png

    folder = build_tiny_vlm(Path(tempfile.mkdtemp()) / "vlm-bench", model_cache_dir(),
                            image_size=336, hidden=512, layers=4, vision_hidden=256)  # fmt: skip
    model, processor, config = load_vision(str(folder))
    prompter = VisionPrompter(processor, config, "bench")

    def request(image: bytes, question: str, rid: str) -> GenerationRequest:
        url = "data:image/png;base64," + base64.b64encode(image).decode()
        body = {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, {
            "role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": question}]}]}  # fmt: skip
        parsed = parse_request("/v1/chat/completions", body)
        tokens, _, spans, inputs = prompter.prompt(parsed.messages, parsed.media)  # type: ignore[union-attr]
        return GenerationRequest(rid, tokens, SamplingParams(max_tokens=1, temperature=0.0),
                                 media_spans=spans, media=inputs)  # fmt: skip

    a, b = png(1, (400, 300)), png(2, (400, 300))
    q1, q2 = "What is in this picture?", "Which colour covers most of it?"
    rows = [("cold: new image, new question", b, "Describe the picture."),
            ("same image, other question", a, q2),
            ("same image and prompt (HIT)", a, q1),
            ("other image, same question", b, q1)]  # fmt: skip
    # rows interleaved within each repeat, so a busy moment of the machine spreads over them all
    times: dict[str, list[float]] = {label: [] for label, _, _ in rows}
    seen: dict[str, tuple[int, int, int]] = {}
    for i in range(args.repeats):
        for label, image, question in rows:
            eng = vision_engine(model, processor, context_length=4096,
                               config=EngineSettings(cache_max_blocks=512))  # fmt: skip
            eng.generate([request(a, q1, "prime")])  # the cache holds image a with question q1
            runs = eng.runner.vision_runs
            req = request(image, question, f"r{i}")
            t0 = time.perf_counter()
            out = eng.generate([req])[0]
            times[label].append(time.perf_counter() - t0)
            seen[label] = (out.prompt_tokens, out.cached_tokens, eng.runner.vision_runs - runs)
    cold = min(times[rows[0][0]])
    lines = ["| request | prompt tokens | cached tokens | vision tower runs | best ms | "
             "median ms | saved (best) |", "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for label, _, _ in rows:
        n, cached, vision = seen[label]
        best, med = min(times[label]), statistics.median(times[label])
        lines.append(f"| {label} | {n} | {cached} | {vision} | {best * 1000:.1f} | "
                     f"{med * 1000:.1f} | {100 * (1 - best / cold):.0f}% |")  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(
            "# Vision prefix cache: prefill saved by image reuse\n\n"
            f"`python -m benchmarks.vision_cache --repeats {args.repeats}`, "
            f"{time.strftime('%Y-%m-%d')}, BATCHMLX_THREADS=1 on a shared 2-core CPU; best and "
            f"median of {args.repeats} fresh engines per row, each primed with image a and the "
            "first question. One new token, so the time is the prefill.\n\n" + text + "\n"
        )


if __name__ == "__main__":
    main()
