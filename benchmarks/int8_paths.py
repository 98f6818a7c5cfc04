"""Which int8 linear-layer path is fastest on this CPU: one model's linear layers, whole step.

Times all the linear layers of one model step (q, k, v, o, gate, up, down per layer, plus the
lm_head), x[M, K] @ W[N, K]^T, every matrix distinct so the weights come from memory as in a
real step, for each path side by side in one process, repeated round-robin, medians kept:

- MLX float32 matmul (the engine's path today: OpenBLAS preloaded under MLX)
- MKL `cblas_gemm_s8u8s32` (the `mkl` wheel): int8 weights, uint8 activations, int32 out
- oneDNN matmul (the `onednn-cpu-gomp` wheel, v3.2): s8 x s8 -> f32 with per-channel scales

The int8 rows time the GEMM alone and, as "+quant", with the per-token activation
quantization and the output scaling a layer needs (numpy, as in batchmlx's int8 kernel).

    eval "$(python -m batchmlx.engine.host.fast_blas --exports)"
    python -m benchmarks.int8_paths --model 135m --rows 8,64,128,1000
    python -m benchmarks.int8_paths --model 1.7b --layers 4   # 1.7B: 4 layers + lm_head

Library folders (MKL, oneDNN) are looked up under sys.prefix/lib; `--lib DIR` adds one.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import statistics
import sys
import time

import numpy as np

SHAPES = {  # hidden, MLP, q heads x head dim, kv width, layers, vocab
    "135m": dict(h=576, f=1536, kv=192, layers=30, vocab=49152),
    "1.7b": dict(h=2048, f=8192, kv=2048, layers=24, vocab=49152),
}


def layer_shapes(s: dict, layers: int) -> list[tuple[int, int]]:
    h, f, kv = s["h"], s["f"], s["kv"]
    one = [(h, h), (kv, h), (kv, h), (h, h), (f, h), (f, h), (h, f)]  # (N, K)
    return one * layers + [(s["vocab"], h)]


def find_lib(names: list[str], extra: list[str]) -> str | None:
    for d in extra + [os.path.join(sys.prefix, "lib")]:
        for n in names:
            hits = sorted(glob.glob(os.path.join(d, n)))
            if hits:
                return hits[0]
    return None


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    from batchmlx.engine.host.linear import quantize_rows as q

    p, s = q(x)
    return p, s[:, None]


def _mkl_gemm(lib: ctypes.CDLL):
    f = lib.cblas_gemm_s8u8s32
    f.restype = None
    f.argtypes = [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                      ctypes.c_int8, ctypes.c_void_p, ctypes.c_int, ctypes.c_int8,
                                      ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                                      ctypes.c_void_p]  # fmt: skip
    return f


def step_runs(
    m: int,
    s: dict,
    shapes: list,
    mxw: list,
    w8: list,
    ws: list,
    paths: dict,
    rng: np.random.Generator,
) -> dict:
    """The timed callables at M rows: each runs every linear layer of one step once."""
    import mlx.core as mx

    xs = {s["h"]: rng.standard_normal((m, s["h"]), np.float32),
          s["f"]: rng.standard_normal((m, s["f"]), np.float32)}  # fmt: skip
    mxx = {k: mx.array(v) for k, v in xs.items()}
    outs = {n: np.empty((m, n), np.float32) for n, _ in set(shapes)}
    outi = {n: np.empty((m, n), np.int32) for n, _ in set(shapes)}
    q8 = {k: quantize_rows(v) for k, v in xs.items()}
    colsum = [(-128 * w.astype(np.int32).sum(axis=1)).astype(np.int32) for w in w8]

    def run_mlx() -> None:
        mx.eval([mxx[k] @ w.T for w, (n, k) in zip(mxw, shapes, strict=True)])

    def run_mkl(quant: bool) -> None:
        f = _mkl_gemm(paths["mkl"])
        for w, sc, cs, (n, k) in zip(w8, ws, colsum, shapes, strict=True):
            q, qs = quantize_rows(xs[k]) if quant else q8[k]
            u = q.view(np.uint8) ^ np.uint8(0x80)  # q + 128; MKL wants uint8 activations
            # column-major C^T[N, M] = W[N, K] . U^T[K, M]; column offset -128 sum(W) undoes +128
            f(102, 112, 111, 172, n, m, k, 1.0, w.ctypes.data, k, 0, u.ctypes.data, k, 0, 0.0,
              outi[n].ctypes.data, n, cs.ctypes.data)  # fmt: skip
            if quant:
                np.multiply(outi[n], sc, out=outs[n])
                outs[n] *= qs

    def run_dnnl(quant: bool) -> None:
        from batchmlx.engine.host.onednn import DataType

        d = paths["onednn"]
        for w, sc, (n, k) in zip(w8, ws, shapes, strict=True):
            q, qs = quantize_rows(xs[k]) if quant else q8[k]
            d.matmul(q, w, outs[n], DataType.S8, sc)
            if quant:
                outs[n] *= qs

    runs = {"MLX f32 (OpenBLAS)": run_mlx}
    if "mkl" in paths:
        runs["MKL s8u8s32 gemm"] = lambda: run_mkl(False)
        runs["MKL s8u8s32 +quant"] = lambda: run_mkl(True)
    if "onednn" in paths:
        runs["oneDNN s8s8 matmul"] = lambda: run_dnnl(False)
        runs["oneDNN s8s8 +quant"] = lambda: run_dnnl(True)
    return runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="135m", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="layers (0: the model's own)")
    ap.add_argument("--rows", default="8,64,128,1000")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--lib", action="append", default=[])
    ap.add_argument("--skip", default="", help="comma-separated paths to leave out: mkl, onednn")
    a = ap.parse_args()
    import mlx.core as mx

    s = SHAPES[a.model]
    layers = a.layers or s["layers"]
    shapes = layer_shapes(s, layers)
    rng = np.random.default_rng(0)
    print(f"# {a.model}: {layers} layers + lm_head, {len(shapes)} matrices, "
          f"{sum(n * k for n, k in shapes) / 1e6:.0f}M weights; OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '-')}, OPENBLAS_NUM_THREADS="
          f"{os.environ.get('OPENBLAS_NUM_THREADS', '-')}; load {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cpus", flush=True)  # fmt: skip
    w32 = [(rng.standard_normal((n, k), np.float32) * 0.02) for n, k in shapes]
    ws = [np.abs(w).max(axis=1) / np.float32(127.0) for w in w32]
    w8 = [np.rint(w / sc[:, None]).astype(np.int8) for w, sc in zip(w32, ws, strict=True)]
    mxw = [mx.array(w) for w in w32]
    mx.eval(mxw)
    del w32

    paths: dict[str, object] = {}
    skip = set(a.skip.split(","))
    mkl_path = find_lib(["libmkl_rt.so*"], a.lib)
    if mkl_path and "mkl" not in skip:
        paths["mkl"] = ctypes.CDLL(mkl_path)
    dnnl_path = find_lib(["libdnnl.so.3.2", "libdnnl.so.3"], a.lib)
    if dnnl_path and "onednn" not in skip:
        from batchmlx.engine.host.onednn import OneDNN

        paths["onednn"] = OneDNN(dnnl_path)
    print(f"# MKL: {mkl_path}\n# oneDNN: {dnnl_path}", flush=True)

    rows = [int(r) for r in a.rows.split(",")]
    results: dict[tuple[str, int], list[float]] = {}
    for m in rows:
        runs = step_runs(m, s, shapes, mxw, w8, ws, paths, rng)
        for fn in runs.values():
            fn()  # warm: primitives made, pages touched
        for _ in range(a.reps):  # round-robin, so load changes hit every path alike
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                results.setdefault((name, m), []).append((time.perf_counter() - t0) * 1e3)
        print(f"# rows {m} done, load {os.getloadavg()[0]:.1f}", flush=True)

    names = list(dict.fromkeys(k for k, _ in results))
    print(f"\nms per step of all {len(shapes)} linear layers: median of {a.reps} (min)")
    print("| path | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in names:
        cells = []
        for m in rows:
            t = results[(name, m)]
            cells.append(f"{statistics.median(t):.1f} (min {min(t):.1f})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
