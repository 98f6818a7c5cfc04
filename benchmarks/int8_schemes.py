"""Which 8-bit scheme is as faithful as llama.cpp's Q8_0 (issue 47): each candidate simulated
exactly in numpy inside the real engine path, and measured by `benchmarks.fidelity`'s own
`score` (same text, chunks and scored positions as `python -m benchmarks.fidelity --peers`).

A scheme's engine is the float32 host engine (`--dtype float32` on the host, as the fidelity
reference runs) whose every host GEMM (`SharedGemm.host`: the host steps' and the MLX layers'
single GEMM entry) is replaced, on that instance only, by a simulation of an int8 kernel:

- **grouped (G = 32, 64, 128)**: weights and each layer input quantized symmetrically to int8
  in groups of G along K, a float32 scale per (row, group) on both sides (Q8_0 is G = 32 with
  float16 scales: `q8_0`). The integer products of one group are exact in float32 (|sum| <=
  128 x 127 x 127 < 2^24), so each group's sum is a float32 matmul of small integers; then,
  group by group in order, out += (t[m, g] * s[n, g]) * sum (float32, no FMA): what a grouped
  int8 kernel computes, bit for bit, in that order.
- **per channel** (batchmlx's `--dtype int8` today): weights int8 per output channel, inputs
  per token over all of K; the integer sum exact (split in pieces of <= 1,024 summed in
  float64), then float32(sum) * s * t as oneDNN's s8 GEMM and `quantize_rows` give it.
- **LLM.int8()** (`llm<p>`): per channel as above, but the p% input channels with the largest
  max |activation| on a calibration pass (different text) are left out of the int8 part and
  computed in float32, then added.
- **SmoothQuant** (`smooth`): per channel, with s_j = max|X_j|^0.5 / max|W_j|^0.5 migrated into
  the weights (x / s, W * s) before quantizing; a kernel folds 1/s into the op before.

The LM head (SmolLM2's tied embedding) computes as llama.cpp's Q8_0 GGUF holds it: token_embd
is Q8_0 (blocks of 32, float16 scales) and its matmul quantizes its input to Q8_0 too; the
embedding lookup reads the same Q8_0 rows. `channel-own-head` is the exception: today's format
throughout, head and lookup per channel, which reproduces `--dtype int8` (a check of the
simulation against oneDNN). Two diagnostics split the error: `head-only` (float32 layers, the
Q8_0 head) and `g32-f32head` / `g64-f32head` (grouped layers, a float32 head and lookup).

    python -m benchmarks.int8_schemes [--schemes g32,g64,...] [--chunks 32] [--json]
    python -m benchmarks.int8_schemes --table rows.jsonl ...   # the markdown table of saved rows
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import fidelity

INT8_MAX = 127
EXACT_K = 1024  # int8 products summed over <= 1,040 terms are exact in float32 (< 2^24)
TILE = 1 << 18  # elements of one [rows, cols] tile of a grouped product (1 MB float32)
ROWS = 512  # rows per piece of a per-channel product (float64 intermediates stay small)
CALIBRATION_TOKENS = 512


@dataclass(frozen=True)
class Scheme:
    """One 8-bit scheme for every linear layer but the head (see the module doc)."""

    name: str
    group: int | None = None  # G along K on both sides; None: per output channel x per token
    fp16_scales: bool = False  # Q8_0 stores its scales as float16
    outliers: float = 0.0  # LLM.int8(): this share of input channels computed in float32
    smooth: float | None = None  # SmoothQuant's migration strength alpha
    own_head: bool = False  # the head (and lookup) in this scheme too, not Q8_0
    head_float: bool = False  # the head (and lookup) left float32 (a diagnostic)
    layers: bool = True  # False: the layers left float32, only the head quantized (a diagnostic)
    cost: str = ""  # the kernel's extra work against per-channel int8, per output element

    def describe(self) -> str:
        if self.group is not None:
            kind = f"int8 G={self.group} both sides, {'fp16' if self.fp16_scales else 'f32'} scales"
        else:
            kind = "int8 per channel x per token"
        if self.outliers:
            kind += f" + top {self.outliers:.0%} input channels in float32"
        if self.smooth is not None:
            kind += f" + SmoothQuant a={self.smooth}"
        if not self.layers:
            kind = "float32 layers"
        head = "float32" if self.head_float else "the same" if self.own_head else "Q8_0"
        return f"{kind}, head {head}"


# cost: a rough kernel note. An int8 GEMM's inner work is K/4 VNNI multiply-adds per 16 outputs;
# a group adds a convert, a scale product and an FMA (3 ops) per G/4 of them; an outlier column
# a float32 FMA where int8 does 4 MACs (the columns: of K = 576 / 1536).
G32, G64, G128 = "~+38% (18 / 48 groups)", "~+19% (9 / 24 groups)", "~+9% (5 / 12 groups)"
SCHEMES = {s.name: s for s in (
    Scheme("channel-own-head", own_head=True, cost="0: today's `--dtype int8`"),
    Scheme("channel", cost="0 (one s*t rescale per output)"),
    Scheme("q8_0", group=32, fp16_scales=True, cost=G32),
    Scheme("g32", group=32, cost=G32),
    Scheme("g64", group=64, cost=G64),
    Scheme("g128", group=128, cost=G128),
    Scheme("llm1", outliers=0.01, cost="~+4%: float32 over 6 / 15 columns, + their split"),
    Scheme("llm2", outliers=0.02, cost="~+8%: float32 over 12 / 31 columns, + their split"),
    Scheme("llm4", outliers=0.04, cost="~+16%: float32 over 23 / 61 columns, + their split"),
    Scheme("smooth", smooth=0.5, cost="0 at run time (1/s folded into the op before)"),
    Scheme("smooth-g128", group=128, smooth=0.5, cost=G128),
    Scheme("smooth-g64", group=64, smooth=0.5, cost=G64),
    Scheme("llm1-g128", group=128, outliers=0.01, cost="~+13%: G=128 and llm1"),
    Scheme("llm1-g64", group=64, outliers=0.01, cost="~+23%: G=64 and llm1"),
    Scheme("smooth-llm1", smooth=0.5, outliers=0.01, cost="~+4%: llm1 after SmoothQuant"),
    Scheme("smooth-llm1-g128", group=128, smooth=0.5, outliers=0.01,
           cost="~+13%: G=128 and llm1 after SmoothQuant"),
    # diagnostics: the Q8_0 head's own share, and the layers' without it
    Scheme("head-only", layers=False, cost="(the Q8_0 head alone)"),
    Scheme("g32-f32head", group=32, head_float=True, cost=G32 + ", head float32"),
    Scheme("g64-f32head", group=64, head_float=True, cost=G64 + ", head float32"),
)}  # fmt: skip
HEAD = Scheme("head", group=32, fp16_scales=True)  # llama.cpp's Q8_0 token_embd / output


def log(msg: str) -> None:
    print(f"[int8_schemes] {msg}", file=sys.stderr, flush=True)


# -- the arithmetic (pure) --------------------------------------------------------------------


def quantize_groups(x: np.ndarray, group: int, fp16: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 of x [M, K] in groups of `group` along K (K padded with zeros to a whole
    number of groups): (ints [M, n, group] as float32, scales [M, n] float32), x ~= ints * s,
    s = max|x_group| / 127 (1 for an all-zero group), ints = rint(x * (1 / s)) as
    `quantize_rows` (and ggml's quantize_row_q8_0) rounds them. fp16: the scales then kept as
    float16 (Q8_0's), the integers as rounded with the float32 scale (as ggml does)."""
    m, k = x.shape
    n = -(-k // group)
    xg = np.zeros((m, n * group), np.float32)
    xg[:, :k] = x
    xg = xg.reshape(m, n, group)
    s = np.abs(xg).max(axis=2) * np.float32(1.0 / INT8_MAX)
    s[s == 0] = 1.0
    ints = np.rint(xg * (np.float32(1.0) / s)[..., None])
    if fp16:
        s = s.astype(np.float16).astype(np.float32)
    return ints, s


def grouped_matmul(pa: np.ndarray, ta: np.ndarray, qw: np.ndarray, sw: np.ndarray) -> np.ndarray:
    """out [M, N] = sum over groups g in order of (ta[m, g] * sw[n, g]) * (pa[m, g] . qw[g, :, n]),
    each group's integer sum exact (a float32 matmul of int8 values over <= 128 terms), the
    scaling and the sum over groups float32. pa [M, ng, G] and qw [ng, G, N] hold integers as
    float32; ta [M, ng], sw [ng, N] the scales. Tiled so each tile's temporaries stay in cache."""
    m, ng, g_len = pa.shape
    n = qw.shape[2]
    assert g_len <= 128 and qw.shape[:2] == (ng, g_len), "groups of at most 128"
    a_groups = np.ascontiguousarray(pa.transpose(1, 0, 2))  # [ng, M, G]
    out = np.zeros((m, n), np.float32)
    mc = min(m, 256)
    nc = max(256, TILE // max(mc, 1))
    for m0 in range(0, m, mc):
        m1 = min(m, m0 + mc)
        for n0 in range(0, n, nc):
            n1 = min(n, n0 + nc)
            o = out[m0:m1, n0:n1]
            acc = np.empty((m1 - m0, n1 - n0), np.float32)
            d = np.empty_like(acc)
            for g in range(ng):
                np.matmul(a_groups[g, m0:m1], qw[g, :, n0:n1], out=acc)
                np.multiply(ta[m0:m1, g, None], sw[g, None, n0:n1], out=d)
                acc *= d
                o += acc
    return out


def channel_matmul(p: np.ndarray, t: np.ndarray, qt: np.ndarray, s: np.ndarray) -> np.ndarray:
    """out [M, N] = float32(p . qt) * s * t, the integer sum exact: p [M, K] and qt [K, N] hold
    int8 values as float32, t [M] the per-token scales, s [N] the per-channel ones (oneDNN's
    s8 GEMM with output scales s, then `out *= t` as SharedGemm.host does)."""
    m, k = p.shape
    out = np.empty((m, qt.shape[1]), np.float32)
    for r0 in range(0, m, ROWS):
        rows = slice(r0, min(m, r0 + ROWS))
        if k <= EXACT_K:
            acc = p[rows] @ qt
        else:  # pieces each exact in float32, summed exactly in float64
            wide = np.zeros((rows.stop - rows.start, qt.shape[1]), np.float64)
            for k0 in range(0, k, EXACT_K):
                wide += p[rows, k0 : k0 + EXACT_K] @ qt[k0 : k0 + EXACT_K]
            acc = wide.astype(np.float32)
        acc *= s
        acc *= t[rows, None]
        out[rows] = acc
    return out


# -- one GEMM in a scheme ---------------------------------------------------------------------


class SimGemm:
    """A SharedGemm's product in `scheme`, from its float32 weights [N, K]; `amax` (the
    calibration pass's max |x| per input channel) for LLM.int8() and SmoothQuant."""

    def __init__(self, w: np.ndarray, bias: np.ndarray | None, scheme: Scheme,
                 amax: np.ndarray | None = None) -> None:  # fmt: skip
        w = np.asarray(w, np.float32)
        self.scheme, self.bias, self.k = scheme, bias, w.shape[1]
        self.cols: np.ndarray | None = None  # LLM.int8()'s float columns
        self.inv: np.ndarray | None = None  # SmoothQuant's 1/s per input channel
        if scheme.smooth is not None:
            assert amax is not None, "SmoothQuant needs a calibration pass"
            a = scheme.smooth
            sm = np.maximum(amax, 1e-5) ** a / np.maximum(np.abs(w).max(axis=0), 1e-5) ** (1 - a)
            self.inv = (1.0 / sm).astype(np.float32)
            w = w * sm.astype(np.float32)
        if scheme.outliers:
            assert amax is not None, "LLM.int8() needs a calibration pass"
            n_out = max(1, round(scheme.outliers * self.k))
            self.cols = np.sort(np.argsort(amax, kind="stable")[-n_out:])
            self.w_float = np.ascontiguousarray(w[:, self.cols].T)  # [n_out, N]
            w = w.copy()
            w[:, self.cols] = 0.0
        group = scheme.group or self.k
        ints, s = quantize_groups(w, group, scheme.fp16_scales)  # [N, ng, G], [N, ng]
        self.rows = (ints * s[..., None]).reshape(w.shape[0], -1)[:, : self.k]  # dequantized
        if scheme.group is None:
            self.qt, self.s = np.ascontiguousarray(ints[:, 0].T), s[:, 0].copy()
        else:
            self.qw = np.ascontiguousarray(ints.transpose(1, 2, 0))  # [ng, G, N]
            self.sw = np.ascontiguousarray(s.T)  # [ng, N]

    def host(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """SharedGemm.host's contract: out [M, N] = x [M, K] . W^T (+ bias), float32."""
        x = np.asarray(x, np.float32).reshape(-1, self.k)
        if self.inv is not None:
            x = x * self.inv
        xi = x
        if self.cols is not None:
            xi = x.copy()
            xi[:, self.cols] = 0.0
        sc = self.scheme
        ints, t = quantize_groups(xi, sc.group or self.k, sc.fp16_scales)
        if sc.group is None:
            got = channel_matmul(ints[:, 0], t[:, 0], self.qt, self.s)
        else:
            got = grouped_matmul(ints, t, self.qw, self.sw)
        if self.cols is not None:
            got += np.ascontiguousarray(x[:, self.cols]) @ self.w_float
        if self.bias is not None:
            got += self.bias
        if out is None:
            return got
        out[...] = got
        return out


# -- into the engine --------------------------------------------------------------------------


def _gemms(model: Any) -> tuple[list[Any], Any]:
    """The model's SharedGemms (each once) but the head's, and the head's."""
    from batchmlx.engine.host.linear import HostEmbedding, HostLinear

    head_layer = getattr(model, "lm_head", None)
    head = head_layer._gemm if head_layer is not None else model.model.embed_tokens._gemm
    seen: dict[int, Any] = {}
    for _, m in model.named_modules():
        if isinstance(m, (HostLinear, HostEmbedding)) and m._gemm is not head:
            seen.setdefault(id(m._gemm), m._gemm)
    return list(seen.values()), head


def calibrate(eng: fidelity.EngineLogits, tokens: list[int]) -> dict[int, np.ndarray]:
    """max |x| per input channel of every GEMM (keyed by id) over one float32 prompt step."""
    gemms, _ = _gemms(eng.loaded.model)
    amax: dict[int, np.ndarray] = {}

    def recorder(gemm: Any) -> Any:
        plain = gemm.host

        def host(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
            m = np.abs(np.asarray(x, np.float32).reshape(-1, gemm._w.k)).max(axis=0)
            amax[id(gemm)] = np.maximum(amax.get(id(gemm), 0.0), m)
            return plain(x, out)

        return host

    for g in gemms:
        g.host = recorder(g)
    try:
        eng.logits([tokens], range(len(tokens) - 1))
    finally:
        for g in gemms:
            del g.host  # the class's method again
    eng.forward_s = 0.0
    return amax


def calibration_tokens(tokenizer: Any) -> list[int]:
    """A few hundred tokens of other text than the scored one: the benchmarks' fixed prompts."""
    from benchmarks import workloads

    text = "\n".join([*workloads.QUESTIONS, *workloads._SYSTEM_SENTENCES])
    return list(tokenizer.encode(text, add_special_tokens=False))[:CALIBRATION_TOKENS]


def install(eng: fidelity.EngineLogits, scheme: Scheme) -> None:
    """Every host GEMM of the (float32 host) engine in `scheme`, its head and embedding lookup
    as llama.cpp's Q8_0 (in the scheme: `own_head`; left float32: `head_float`)."""
    import mlx.core as mx

    model = eng.loaded.model
    amax = None
    if scheme.outliers or scheme.smooth is not None:
        amax = calibrate(eng, calibration_tokens(eng.loaded.tokenizer))
    gemms, head = _gemms(model)
    for g in gemms if scheme.layers else []:
        sim = SimGemm(g._w.buffer, g.bias, scheme, None if amax is None else amax.get(id(g)))
        del sim.rows  # only the head's lookup reads them
        g.host = sim.host
    if scheme.head_float:
        return
    head_scheme = scheme if scheme.own_head else HEAD
    sim = SimGemm(head._w.buffer, head.bias, head_scheme)
    head.host = sim.host
    emb = model.model.embed_tokens
    if getattr(model, "lm_head", None) is None:  # tied: the lookup reads the head's rows
        rows = np.ascontiguousarray(sim.rows, dtype=np.float32)
        emb.weight = mx.array(rows)
        if eng.runner.forward_pass.host is not None:
            eng.runner.forward_pass.host._embed = rows
    del sim.rows


class SchemeLogits(fidelity.EngineLogits):
    """fidelity's EngineLogits, for which a scheme's name is a dtype: the float32 host engine
    with the scheme installed."""

    def __init__(self, dtype: str, model: str = "default", host_f32: bool = False) -> None:
        scheme = SCHEMES.get(dtype)
        if scheme is None:
            super().__init__(dtype, model, host_f32)
            return
        super().__init__("float32", model, host_f32=True)
        t0 = time.perf_counter()
        install(self, scheme)
        self.load_s += time.perf_counter() - t0
        self.dtype = dtype

    def describe(self) -> str:
        scheme = SCHEMES.get(self.dtype)
        return super().describe() if scheme is None else f"{scheme.describe()} (simulated)"


def measure(names: list[str], text: Path, ctx: int, chunks: int) -> list[dict[str, Any]]:
    """`fidelity.score` over these schemes (or batchmlx dtypes), its engines SchemeLogits."""
    plain = fidelity.EngineLogits
    fidelity.EngineLogits = SchemeLogits  # type: ignore[misc]
    try:
        got = fidelity.score(names, fidelity.read_text(text), ctx, chunks)
    finally:
        fidelity.EngineLogits = plain  # type: ignore[misc]
    return [fidelity.result(got, n, ctx, text, "default") for n in names]


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| scheme | computes | positions | same_top | kld_mean | ppl | extra kernel work "
             "over int8 MACs | s |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        scheme = SCHEMES.get(r["dtype"])
        lines.append(f"| {r['dtype']} | {r['weights']} | {r['positions']:,} | "
                     f"{r['same_top']:.4f} | {r['kld_mean']:.6f} | {r['ppl']:.4f} | "
                     f"{scheme.cost if scheme else ''} | {r['forward_s']:.0f} |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schemes", default=",".join(SCHEMES),
                   help=f"comma-separated: {', '.join(SCHEMES)} (or a --dtype)")  # fmt: skip
    p.add_argument("--text", type=Path, help="a UTF-8 text file (default: alice29.txt)")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=fidelity.DEFAULT_CHUNKS)
    p.add_argument("--json", action="store_true", help="JSON lines only (no table)")
    p.add_argument("--table", type=Path, nargs="*", help="render saved JSON lines, run nothing")
    args = p.parse_args(argv)
    if args.table:
        rows = [json.loads(line) for f in args.table for line in f.read_text().splitlines()
                if line.startswith("{")]  # fmt: skip
        print("\n".join(table(rows)))
        return 0
    text = args.text or fidelity.ensure_text()
    rows = measure(args.schemes.split(","), text, args.ctx, args.chunks)
    for r in rows:
        print(json.dumps(r), flush=True)
    if not args.json:
        print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
