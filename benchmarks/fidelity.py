"""How far a precision moves the model's next-token distributions from float32's, measured the
way llama.cpp's `llama-perplexity --kl-divergence` measures a quantization.

The text is tokenized whole (BOS first where the tokenizer adds one), cut into chunks of `ctx`
tokens (the tail that fills no chunk is dropped), and each chunk is run from scratch, its first
token replaced by BOS where the tokenizer adds one; only the logits of positions ctx/2 .. ctx-2
are scored, each against the chunk's next token: ctx - 1 - ctx/2 positions a chunk. The model
runs as batchmlx runs it at that dtype: `load_model` (bf16 and int8 host formats through
oneDNN, float32, stored, ...) and the engine `make_engine` makes for it, each step a packed
prompt step of up to four chunks (2,048 tokens, the engine's step budget) through the runner's
own forward pass (`PagedForward.forward`: host steps or MLX), its KV in the runner's paged pool.
The one difference from a served prompt: the step's layout names every scored row where a
prompt step names each sequence's last, so the head projects those rows too.

Per scored position, against the same model loaded as float32: same_top (the argmax is
float32's), KL(float32 || dtype) in nats, and the target's NLL under each (ppl = exp of the
mean). The text by default: Alice's Adventures in Wonderland (alice29.txt of the Canterbury
corpus), as the `brotli` sdist on PyPI ships it among its test data (`ensure_text`).

    python -m benchmarks.fidelity [--text FILE] [--ctx 512] [--chunks 32] [--dtype D]
        [--model M] [--json]
    python -m benchmarks.fidelity --peers   # batchmlx float32/bf16/int8 beside llama.cpp's
                                            # F32/Q8_0/Q4_0 (peers/perplexity.py): a table
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.peers.setup import CACHE as BENCH_CACHE

# Alice's Adventures in Wonderland (Lewis Carroll, 1865; public domain), Project Gutenberg's
# Millennium Fulcrum Edition 2.9 as the Canterbury corpus's alice29.txt, in the brotli sdist
# (MIT-licensed) among its test data. Only that one file is read; nothing is installed.
TEXT_PACKAGE = "brotli==1.2.0"
TEXT_MEMBER = "tests/testdata/alice29.txt"
TEXT_SHA256 = "7467306ee0feed4971260f3c87421154a05be571d944e9cb021a5713700c38f0"  # as shipped
DEFAULT_CHUNKS = 32  # 32 x 255 = 8,160 scored positions at ctx 512 (16,384 tokens)
STEP_TOKENS = 2048  # the engine's step budget (EngineSettings.max_prefill_tokens)
PEER_DTYPES = ("float32", "auto", "int8")
PEER_QUANTS = ("Q8_0", "Q4_0")


def log(msg: str) -> None:
    print(f"[fidelity] {msg}", file=sys.stderr, flush=True)


# -- the text ---------------------------------------------------------------------------------


def ensure_text() -> Path:
    """alice29.txt from the brotli sdist (pip download --no-deps, never installed), its CRLF
    line ends made LF, cached under $BATCHMLX_BENCH_CACHE/text/."""
    dest = BENCH_CACHE / "text" / "alice29.txt"
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        log(f"fetching the text: {TEXT_PACKAGE}'s sdist, {TEXT_MEMBER}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", "--disable-pip-version-check", TEXT_PACKAGE, "-d", tmp],
                       check=True, capture_output=True)  # fmt: skip
        sdist = next(Path(tmp).glob("*.tar.gz"))
        with tarfile.open(sdist) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/" + TEXT_MEMBER))
            raw = tar.extractfile(member).read()  # type: ignore[union-attr]
        digest = hashlib.sha256(raw).hexdigest()
        if digest != TEXT_SHA256:
            raise RuntimeError(f"{TEXT_MEMBER} of {sdist.name}: sha256 {digest}, expected "
                               f"{TEXT_SHA256}")  # fmt: skip
        part = Path(tmp) / "text"
        part.write_bytes(raw.replace(b"\r\n", b"\n"))
        part.replace(dest)
    return dest


def read_text(path: Path) -> str:
    """The file as llama.cpp's `-f` reads it: whole, less one trailing newline."""
    text = Path(path).read_text(encoding="utf-8")
    return text[:-1] if text.endswith("\n") else text


# -- chunks and the arithmetic (pure) ---------------------------------------------------------


def tokenize(tokenizer: Any, text: str) -> tuple[list[int], int | None]:
    """(tokens, bos): the text's tokens as llama.cpp's perplexity takes them (special tokens
    added: BOS first where the tokenizer adds one), and that BOS id (None where it adds none)."""
    plain = list(tokenizer.encode(text, add_special_tokens=False))
    full = list(tokenizer.encode(text, add_special_tokens=True))
    if full[-len(plain) :] != plain or len(full) - len(plain) > 1:
        raise ValueError("the tokenizer adds more than a BOS: llama-perplexity asserts no EOS")
    return full, (full[0] if len(full) > len(plain) else None)


def chunks_of(tokens: list[int], ctx: int, max_chunks: int | None = None,
              bos: int | None = None) -> list[list[int]]:  # fmt: skip
    """llama-perplexity's chunks: consecutive runs of `ctx` tokens (the tail that fills none
    dropped), at most `max_chunks`, each one's first token replaced by `bos` (when given)."""
    if len(tokens) < 2 * ctx:
        raise ValueError(f"{len(tokens)} tokens: llama-perplexity needs at least 2 x ctx "
                         f"({2 * ctx})")  # fmt: skip
    n = len(tokens) // ctx
    if max_chunks is not None:
        n = min(n, max_chunks)
    out = []
    for i in range(n):
        chunk = list(tokens[i * ctx : (i + 1) * ctx])
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def scored(ctx: int) -> range:
    """The positions of a chunk whose logits are scored (each against the token after it)."""
    return range(ctx // 2, ctx - 1)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log-probabilities over the last axis, in float64."""
    z = np.asarray(x, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@dataclass(slots=True)
class Tally:
    """Sums over scored positions of one dtype against the reference (float32)."""

    positions: int = 0
    same_top: int = 0
    kld: float = 0.0  # sum of KL(reference || dtype), nats
    nll: float = 0.0  # sum of the targets' NLL under the dtype
    nll_ref: float = 0.0  # ... under the reference

    def add(self, ref_logits: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> None:
        """ref_logits, logits [N, V]; targets [N] the token each position predicts."""
        lr, lq = log_softmax(ref_logits), log_softmax(logits)
        rows = np.arange(len(targets))
        self.positions += len(targets)
        self.same_top += int((lr.argmax(-1) == lq.argmax(-1)).sum())
        self.kld += float((np.exp(lr) * (lr - lq)).sum())
        self.nll -= float(lq[rows, targets].sum())
        self.nll_ref -= float(lr[rows, targets].sum())

    def summary(self) -> dict[str, Any]:
        n = max(self.positions, 1)
        return {
            "positions": self.positions,
            "same_top": self.same_top / n,
            "kld_mean": self.kld / n,
            "ppl": math.exp(self.nll / n),
            "ppl_float32": math.exp(self.nll_ref / n),
        }


# -- batchmlx's engine ------------------------------------------------------------------------


def _float32_on_host(model: Any) -> None:
    """The float32 weights in the host float32 format (oneDNN, host steps), as `--dtype auto`
    runs on a CPU whose oneDNN has no bf16 matmul: the same float32 arithmetic as MLX's float32
    path (logits within ~1e-5: tests/engine/test_host_step.py), which on this CPU ran a
    2,048-token step in 146 s against 2.5 s on the host. Where oneDNN cannot load: MLX."""
    from batchmlx.engine.host.linear import HostFormat, to_host_format
    from batchmlx.engine.host.onednn import OneDNNUnavailable

    try:
        to_host_format(model, HostFormat.F32)
    except OneDNNUnavailable as exc:
        log(f"the float32 reference runs in MLX: {exc}")


class EngineLogits:
    """The model as batchmlx runs it at `dtype`: `load_model`, then the engine `make_engine`
    makes; `logits` runs a packed prompt step of whole chunks through its runner's forward pass
    over its paged KV pool and returns the logits of the scored rows."""

    def __init__(self, dtype: str, model: str = "default", host_f32: bool = False) -> None:
        from batchmlx.core.engine_api import EngineSettings
        from batchmlx.core.models import resolve_model
        from batchmlx.engine.choose import make_engine
        from batchmlx.engine.models.loader import load_model
        from benchmarks.peers.models import BMX_CACHE

        spec = resolve_model(model, cache_dir=BMX_CACHE)
        if spec is None:
            raise ValueError(f"no such model: {model!r}")
        t0 = time.perf_counter()
        self.dtype = dtype
        self.loaded = load_model(spec, cache_dir=BMX_CACHE, dtype=dtype)
        if host_f32:
            _float32_on_host(self.loaded.model)
        self.load_s = time.perf_counter() - t0
        self.engine = make_engine(self.loaded.model, self.loaded.tokenizer, name=spec.name,
                                  context_length=self.loaded.context_length,
                                  config=EngineSettings())  # fmt: skip
        runner = self.engine.runner
        if not getattr(runner, "mixed_steps", False):
            raise NotImplementedError(f"{spec.name} does not run packed steps in batchmlx: "
                                      "this benchmark reads every scored row of one")  # fmt: skip
        self.runner = runner
        self.forward_s = 0.0
        self.host_steps = runner.forward_pass.host is not None

    def logits(self, chunks: list[list[int]], rows: range) -> np.ndarray:
        """[len(chunks), len(rows), V] float32: chunk i's logits at positions `rows`, all the
        chunks in one packed step from position 0 (blocks of their own in the runner's pool)."""
        import mlx.core as mx

        from batchmlx.engine.kv.paged import PackedLayout

        runner, storage = self.runner, self.runner.storage
        bs = runner.cfg.block_size
        per = -(-max(len(c) for c in chunks) // bs)
        tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(len(chunks))]
        storage.ensure_capacity(1 + len(chunks) * per)  # block 0 is the scratch block
        layout = PackedLayout.build(
            block_size=bs, n_kv_heads=storage.n_kv_heads, token_chunks=chunks,
            starts=[0] * len(chunks), block_tables=tables,
            share_prefix=runner.sliding_window is None,
        )  # fmt: skip
        last = np.asarray(layout.last_index)
        picked = [last[i] - (len(c) - 1) + np.asarray(rows) for i, c in enumerate(chunks)]
        layout = dataclasses.replace(layout, last_index=mx.array(np.concatenate(picked), mx.int32))
        t0 = time.perf_counter()
        out = runner.forward_pass.forward(layout, None)
        mx.eval(out, storage.keys, storage.values)
        self.forward_s += time.perf_counter() - t0
        return np.array(out.astype(mx.float32)).reshape(len(chunks), len(rows), -1)

    def describe(self) -> str:
        """How the weights compute, as the loader says it (for the JSON line and the table)."""
        from batchmlx.engine.host import q8
        from batchmlx.engine.host.linear import HostEmbedding, HostLinear

        modules = [m for _, m in self.loaded.model.named_modules()]
        gemms = {m._gemm for m in modules if isinstance(m, (HostLinear, HostEmbedding))}
        if gemms:  # the layers' formats, and who computes them (our int8 kernel: grouped)
            who = {"float32": "numpy's BLAS"}
            kinds = sorted({f"{g.fmt.value} G={q8.GROUP} (ours)"
                            if g._q8 is not None or g._q4 is not None or g._h8 is not None
                            else f"{g.fmt.value} ({who.get(g.fmt.value, 'oneDNN')})"
                            for g in gemms})  # fmt: skip
            return f"{' + '.join(kinds)}{', host steps' if self.host_steps else ''}"
        import mlx.nn as nn

        layer = self.loaded.model.model.layers[0].mlp.down_proj
        if isinstance(layer, nn.QuantizedLinear):
            return f"{layer.bits}-bit as stored (MLX)"
        return f"{str(layer.weight.dtype).removeprefix('mlx.core.')} (MLX)"


@dataclass(slots=True)
class Scored:
    """The text's chunks and each dtype's tally against float32."""

    chunks: list[list[int]]
    tokens: int  # the whole text's tokens
    bos: int | None
    tallies: dict[str, Tally]
    engines: dict[str, EngineLogits]


def score(dtypes: list[str], text: str, ctx: int, max_chunks: int | None,
          model: str = "default") -> Scored:  # fmt: skip
    """Every dtype's tally against the same model loaded as float32 (on the host:
    `_float32_on_host`; "float32" in `dtypes` is that reference itself), a step of up to
    STEP_TOKENS / ctx chunks at a time (each model loaded once, all held at once)."""
    engines = {"float32": EngineLogits("float32", model, host_f32=True)}
    for d in dtypes:
        if d not in engines:
            engines[d] = EngineLogits(d, model)
    tokens, bos = tokenize(engines["float32"].loaded.tokenizer, text)
    chunks = chunks_of(tokens, ctx, max_chunks, bos)
    rows = scored(ctx)
    tallies = {d: Tally() for d in dtypes}
    step = max(1, STEP_TOKENS // ctx)
    for s in range(0, len(chunks), step):
        part = chunks[s : s + step]
        ref = engines["float32"].logits(part, rows)
        targets = [np.asarray(c[rows.start + 1 : rows.stop + 1]) for c in part]
        for d in dtypes:
            got = ref if d == "float32" else engines[d].logits(part, rows)
            for i in range(len(part)):
                tallies[d].add(ref[i], got[i], targets[i])
        log(f"chunks {s + len(part)}/{len(chunks)}")
    return Scored(chunks, len(tokens), bos, tallies, engines)


def result(got: Scored, dtype: str, ctx: int, text: Path, model: str) -> dict[str, Any]:
    """One dtype's JSON line."""
    eng = got.engines[dtype]
    return {
        "dtype": dtype, "weights": eng.describe(), "model": model, "text": str(text),
        "ctx": ctx, "chunks": len(got.chunks), "text_tokens": got.tokens,
        "bos": got.bos, **got.tallies[dtype].summary(),
        "load_s": round(eng.load_s, 1), "forward_s": round(eng.forward_s, 1),
    }  # fmt: skip


# -- beside llama.cpp -------------------------------------------------------------------------


def token_agreement(chunks: list[list[int]], bos: int | None, base: Path) -> str:
    """Whether llama.cpp's tokens (its base file's) are batchmlx's chunks' tokens."""
    from benchmarks.peers.perplexity import base_tokens

    _, _, theirs = base_tokens(base)
    ours = np.asarray(chunks, dtype=np.int64)
    if bos is not None:  # llama.cpp saves its tokens before putting BOS in
        theirs = theirs.copy()
        theirs[:, 0] = bos
    if theirs.shape != ours.shape:
        return (f"token counts differ: llama.cpp {theirs.shape[0]} chunks x {theirs.shape[1]}, "
                f"batchmlx {ours.shape[0]} x {ours.shape[1]}")  # fmt: skip
    diff = int((theirs != ours).sum())
    if diff == 0:
        return f"the same {ours.size:,} tokens ({ours.shape[0]} chunks of {ours.shape[1]})"
    return f"{diff} of {ours.size:,} tokens differ (same count: {ours.shape[0]} chunks)"


def peers(text: Path, ctx: int, max_chunks: int) -> list[str]:
    """The table: batchmlx float32 (the reference), auto (bf16), int8; llama.cpp's F32 (its
    own reference), Q8_0 and Q4_0, on the default model, the same text and chunks."""
    from benchmarks.peers.perplexity import scores

    t0 = time.perf_counter()
    got = score(list(PEER_DTYPES), read_text(text), ctx, max_chunks)
    ours = [result(got, d, ctx, text, "default") for d in PEER_DTYPES]
    for r in ours:
        print(json.dumps(r), flush=True)
    log(f"batchmlx: {time.perf_counter() - t0:.0f} s; llama.cpp next")
    work = BENCH_CACHE / "fidelity"
    work.mkdir(parents=True, exist_ok=True)
    theirs, base = scores(text, ctx, len(got.chunks), PEER_QUANTS, work)
    for r in theirs:
        print(json.dumps({"system": "llama.cpp", **dataclasses.asdict(r)}), flush=True)
    lines = [
        "| system | --dtype / GGUF | computes in | positions | same_top | kld_mean | ppl | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ours:
        lines.append(f"| batchmlx | {r['dtype']} | {r['weights']} | {r['positions']:,} | "
                     f"{r['same_top']:.4f} | {r['kld_mean']:.6f} | {r['ppl']:.4f} | "
                     f"{r['forward_s']:.0f} |")  # fmt: skip
    for r in theirs:
        lines.append(
            f"| llama.cpp | {r.name} GGUF | {r.weights} | {r.positions:,} | "
            f"{r.same_top:.4f} | {r.kld_mean:.6f} | {r.ppl:.4f} | {r.seconds:.0f} |"
        )
    return [*lines, "",
            "- tokens: llama.cpp's (its base file's) and batchmlx's chunks hold "
            f"{token_agreement(got.chunks, got.bos, base)}",
            f"- float32 against float32: batchmlx ppl {ours[0]['ppl']:.4f}, llama.cpp F32 "
            f"{theirs[0].ppl:.4f}",
            "- llama.cpp scores against its base file's log-probabilities as stored (16 bits): "
            f"PPL(base) from them {theirs[-1].ppl_base:.4f}",
            "- s: batchmlx, its forward steps alone (loading and scoring apart); llama.cpp, the "
            "whole llama-perplexity process (load, forward, its own scoring)"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", type=Path, help="a UTF-8 text file (default: alice29.txt, fetched)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=DEFAULT_CHUNKS,
                   help=f"at most this many chunks (default {DEFAULT_CHUNKS}; 0: all)")  # fmt: skip
    p.add_argument("--dtype", default="auto", help="batchmlx's --dtype (default auto)")
    p.add_argument("--model", default="default")
    p.add_argument("--json", action="store_true", help="one JSON line (default: a summary)")
    p.add_argument("--peers", action="store_true",
                   help="float32, auto, int8 beside llama.cpp F32/Q8_0/Q4_0")  # fmt: skip
    args = p.parse_args(argv)
    text = args.text or ensure_text()
    chunks = args.chunks or None
    if args.peers:
        if args.model != "default":
            p.error("--peers runs the default model only (the GGUFs are made from its Q4_1)")
        print("\n".join(peers(text, args.ctx, chunks or 10**9)))
        return 0
    got = score([args.dtype], read_text(text), args.ctx, chunks, args.model)
    r = result(got, args.dtype, args.ctx, text, args.model)
    if args.json:
        print(json.dumps(r))
    else:
        print("\n".join(f"{k}: {v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
