"""How close each system's answers are to the exact model: every text a peer run wrote
(`run_peer --json`), scored teacher-forced under the default model's float32 weights in MLX
(the very weights every peer reads: the Q4_1 GGUF, dequantized).

Per system: texts equal to float32's own greedy texts, the share of answer tokens that are
float32's greedy choice at their position (1.0 for float32 itself), and the answer tokens'
mean negative log-likelihood under float32 (lower: likelier text). A faster precision that
only reorders near-ties keeps the share near 1 and the NLL near float32's; one that moves
the logits shows it here before anyone reads the texts.

    python -m benchmarks.peers.run_peer --peer batchmlx --dtype float32 --json f32.json
    python -m benchmarks.peers.run_peer --peer openvino --json ov.json   # ... one per system
    python -m benchmarks.peers.fidelity f32.json bf16.json int8.json ov.json

The first file is the reference (float32). The default model only, unique workload (the
prompts are rebuilt from the workload, as run_peer sent them).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True)
class Fidelity:
    system: str
    precision: str
    equal_texts: int
    texts: int
    greedy_share: float  # answer tokens that are float32's argmax given the text before them
    mean_nll: float  # nats per answer token under float32


def score(model, tok, prompts: dict[str, list[int]], texts: dict[str, str],
          chunk: int = 16) -> tuple[int, int, float]:  # fmt: skip
    """(tokens float32 would have chosen, answer tokens, summed NLL) over texts: the sequences
    right-padded into batches of `chunk` (causal attention: a real token never sees padding)."""
    import mlx.core as mx

    seqs = []
    for cid, text in texts.items():
        answer = tok.encode(text, add_special_tokens=False)
        if answer:
            seqs.append((prompts[cid], answer))
    hits = total = 0
    nll = 0.0
    for i in range(0, len(seqs), chunk):
        part = seqs[i : i + chunk]
        width = max(len(p) + len(a) for p, a in part)
        ids = np.zeros((len(part), width), dtype=np.int32)
        for row, (p, a) in enumerate(part):
            ids[row, : len(p) + len(a)] = p + a
        logits = model(mx.array(ids)).astype(mx.float32)
        lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        for row, (p, a) in enumerate(part):
            at = lp[row, len(p) - 1 : len(p) + len(a) - 1]  # the logits that predict the answer
            target = np.array(a)
            hits += int((at.argmax(-1) == target).sum())
            nll -= float(at[np.arange(len(a)), target].sum())
            total += len(a)
    return hits, total, nll


def scores(runs: list[dict[str, Any]], workload_name: str = "unique") -> list[Fidelity]:
    """Each run (a `PeerRun` as a dict: system, precision, texts) scored under float32; the
    first run is the reference for equal texts."""
    import mlx.core as mx
    from mlx_lm import load

    from batchmlx.engine.models.loader import dequantize_model
    from benchmarks.peers.models import default_mlx_folder
    from benchmarks.peers.run_peer import _tokenizer, requests_of, workload

    tok = _tokenizer("default")
    prompts = {cid: tok.encode(tok.apply_chat_template(m, add_generation_prompt=True,
                                                       tokenize=False), add_special_tokens=False)
               for cid, m in requests_of(workload(workload_name), tok)}  # fmt: skip
    model, _ = load(str(default_mlx_folder()))
    dequantize_model(model, mx.float32)  # the folder is 4-bit: score under its float32 weights
    ref = runs[0]["texts"]
    rows = []
    for r in runs:
        hits, total, nll = score(model, tok, prompts, r["texts"])
        equal = sum(r["texts"].get(c) == t for c, t in ref.items())
        rows.append(Fidelity(r["system"], r["precision"], equal, len(ref), hits / max(total, 1),
                             nll / max(total, 1)))  # fmt: skip
    return rows


# Section 14 of `benchmarks.run`: the default model's unique workload on every system and
# precision, whole process as in section 12, then every system's texts scored under float32.
_NO_DQ = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
SYSTEMS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("batchmlx", {"dtype": "float32"}), ("batchmlx", {}), ("batchmlx", {"dtype": "int8"}),
    ("llama", {}), ("openvino", {}),
    ("openvino", {"props": {**_NO_DQ, "KV_CACHE_PRECISION": "bf16"}}),
    ("openvino", {"props": {"INFERENCE_PRECISION_HINT": "f32", **_NO_DQ,
                            "KV_CACHE_PRECISION": "f32"}}),
)  # fmt: skip


def table(runs: list[Any], found: list[Fidelity]) -> list[str]:
    """Section 14's table: section 12's columns for each run, then its fidelity."""
    lines = [
        "| system | computes in | whole process s | tok/s | load s | steady tok/s | peak RSS MB "
        "| texts equal to float32's | answer tokens that are float32's greedy choice | mean NLL "
        "under float32, nats/token |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, f in zip(runs, found, strict=True):
        lines.append(
            f"| {r.system} | {r.precision} | {r.wall_s:.1f} | {r.tok_s:.1f} | {r.load_s:.1f} | "
            f"{r.steady_tok_s:.1f} | {r.peak_rss_mb:,.0f} | {f.equal_texts}/{f.texts} | "
            f"{f.greedy_share:.3f} | {f.mean_nll:.3f} |"
        )
    return lines


def section(quick: bool = False) -> list[str]:
    """Section 14's lines (no heading): every system of SYSTEMS once, in turn, then scored."""
    from dataclasses import asdict

    from benchmarks.peers.run_peer import PeerRun, workload
    from benchmarks.peers.section import Case, System, measure

    wl = workload("unique", quick=quick)
    case = Case("default", wl, tuple(System(p, o) for p, o in SYSTEMS))
    out = measure(case)
    runs = [r for r in out if isinstance(r, PeerRun)]
    lines = [f"The default model's unique workload ({wl.requests} requests x up to "
             f"{wl.max_tokens} new tokens) on each system, a whole process as in section 12, "
             "in turn; then every system's texts scored teacher-forced under float32 (the Q4_1 "
             "GGUF's weights, which every system reads, dequantized): texts equal to float32's "
             "own, the share of answer tokens that are float32's greedy choice, and their mean "
             "negative log-likelihood.", ""]  # fmt: skip
    if not runs or runs[0].precision != "float32":
        return [*lines, "The float32 run failed: nothing to score against.", ""]
    lines += table(runs, scores([asdict(r) for r in runs], wl.name))
    return [*lines, *(f"- {r}" for r in out if isinstance(r, str)), ""]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run_peer --json files; the first is float32")
    p.add_argument("--workload", default="unique")
    args = p.parse_args(argv)
    runs = [r for f in args.runs for r in json.loads(Path(f).read_text())]
    rows = scores(runs, args.workload)
    print(f"| system | computes in | texts equal to {runs[0]['system']}'s | answer tokens that are "
          "float32's greedy choice | mean NLL under float32, nats/token |")  # fmt: skip
    print("|---|---|---|---|---|")
    for f in rows:
        print(f"| {f.system} | {f.precision} | {f.equal_texts}/{f.texts} | {f.greedy_share:.3f} "
              f"| {f.mean_nll:.3f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
