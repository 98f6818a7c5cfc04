"""llama.cpp's own measure of how far a quantization moves the model: `llama-perplexity`, first
on the F32 GGUF with `--kl-divergence-base` (it saves the float32 log-probabilities of every
scored position, and the tokens), then on each quantized GGUF with `--kl-divergence` against
that file. benchmarks/fidelity.py runs it beside batchmlx's own precisions.

    llama-perplexity -m F32.gguf -f TEXT -c 512 --chunks N --kl-divergence-base base.kld
    llama-perplexity -m Q8_0.gguf -c 512 --kl-divergence-base base.kld --kl-divergence

Each chunk of `-c` tokens runs from scratch, its first token replaced by BOS where the
vocabulary adds one, and only the logits of positions ctx/2 .. ctx-2 are scored (the next
token of each): ctx - 1 - ctx/2 positions a chunk.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.peers.setup import llama_tool


@dataclass(frozen=True, slots=True)
class LlamaScore:
    """One GGUF's figures from llama-perplexity's own output."""

    name: str  # "F32", "Q8_0", ...
    weights: str  # the GGUF's weight types (models.gguf_type)
    chunks: int
    positions: int  # scored positions
    same_top: float  # 1.0 for the base itself
    kld_mean: float  # mean KL(F32 || this), nats
    ppl: float
    ppl_base: float  # the F32 GGUF's perplexity
    seconds: float


def _threads() -> str:
    return str(len(os.sched_getaffinity(0)))


def _run(args: list[str]) -> tuple[str, float]:
    """llama-perplexity's whole output (stdout and log) and its wall time."""
    cmd = ["nice", "-n", "10", llama_tool("llama-perplexity"), "-t", _threads(), *args]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{text[-3000:]}")
    return text, time.perf_counter() - t0


def _number(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    if m is None:
        raise RuntimeError(f"llama-perplexity's output has no {pattern!r}:\n{text[-2000:]}")
    return float(m.group(1))


def parse_base(text: str) -> tuple[int, float]:
    """(chunks, PPL) of a `--kl-divergence-base` run's output."""
    chunks = int(_number(r"calculating perplexity over (\d+) chunks", text))
    return chunks, _number(r"Final estimate: PPL = ([0-9.]+)", text)


def parse_kld(text: str) -> dict[str, float]:
    """The figures of a `--kl-divergence` run's output: chunks, PPL of the model and of the
    base, mean KLD, and same top p (as a fraction)."""
    return {
        "chunks": _number(r"computing over (\d+) chunks", text),
        "ppl": _number(r"Mean PPL\(Q\)\s*:\s*([0-9.]+)", text),
        "ppl_base": _number(r"Mean PPL\(base\)\s*:\s*([0-9.]+)", text),
        "kld_mean": _number(r"Mean\s+KLD:\s*(-?[0-9.]+)", text),
        "same_top": _number(r"Same top p:\s*([0-9.]+)", text) / 100.0,
    }


def base_tokens(path: Path) -> tuple[int, int, np.ndarray]:
    """(n_ctx, n_vocab, tokens [n_chunk, n_ctx]) from a `--kl-divergence-base` file's header:
    "_logits_", n_ctx (uint32), n_vocab, n_chunk (int32), then the tokens it scored, as
    llama.cpp tokenized the text (BOS not yet put in)."""
    with open(path, "rb") as fh:
        if fh.read(8) != b"_logits_":
            raise ValueError(f"{path} is not a llama-perplexity log-probabilities file")
        n_ctx, n_vocab, n_chunk = np.frombuffer(fh.read(12), dtype="<i4").tolist()
        tokens = np.frombuffer(fh.read(4 * n_ctx * n_chunk), dtype="<i4")
    return n_ctx, n_vocab, tokens.reshape(n_chunk, n_ctx)


def scores(text: Path, ctx: int, chunks: int, kinds: tuple[str, ...], workdir: Path,
           ) -> tuple[list[LlamaScore], Path]:  # fmt: skip
    """The F32 GGUF's run (the base, same_top 1) and one `--kl-divergence` run per quantized
    kind, in that order; and the base file (its tokens: `base_tokens`)."""
    from benchmarks.peers.models import default_requantized, gguf_type

    per_chunk = ctx - 1 - ctx // 2
    f32 = default_requantized("F32")
    base = workdir / f"base-{ctx}.kld"
    out, secs = _run(["-m", str(f32), "-f", str(text), "-c", str(ctx), "--chunks", str(chunks),
                      "--kl-divergence-base", str(base)])  # fmt: skip
    n, ppl = parse_base(out)
    rows = [LlamaScore("F32", gguf_type(f32), n, n * per_chunk, 1.0, 0.0, ppl, ppl,
                       round(secs, 1))]  # fmt: skip
    for kind in kinds:
        gguf = default_requantized(kind)
        out, secs = _run(["-m", str(gguf), "-c", str(ctx), "--kl-divergence-base", str(base),
                          "--kl-divergence"])  # fmt: skip
        got = parse_kld(out)
        k = int(got["chunks"])
        rows.append(LlamaScore(kind, gguf_type(gguf), k, k * per_chunk, got["same_top"],
                               got["kld_mean"], got["ppl"], got["ppl_base"],
                               round(secs, 1)))  # fmt: skip
    return rows, base
