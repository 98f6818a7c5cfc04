"""Large elementwise passes of a step, on the host in numpy: the CPU backend's kernels.

MLX runs each elementwise op as its own pass over the whole array. Once a step's activations
outgrow the L2 (a prompt, or a batch of prompts behind a cached system prompt), every one of the
~20 passes of `kernels.fast_swiglu` streams the array through memory again: measured on 1,270
tokens x 1,536 (the MLP of a batch admitted behind a shared system prompt), 25 ms a layer as MLX
ops against 2.0 ms here. Here the array is walked in L2-sized tiles, each tile's passes run while
it is in cache, the two halves go to two threads, and the result is written straight into a
buffer MLX owns (no copy back).

Small arrays (a decode step) stay in MLX: there its passes hit cache and the host's evaluation
and thread hand-off cost more than they save (crossover about 300 tokens x 1,536).

The host steps (engine/host/step.py) take their gated MLPs from here too, on numpy arrays:
SwiGLU, gemma's GeGLU (gelu's tanh approximation) and gemma2's soft-capping; the gated MLPs in
one pass per row in our kernel (ops.py) where it runs: 64 x 1,536 took 54 us there against 825
in the numpy passes below, which stay for a CPU without AVX-512.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from batchmlx.engine.host import ops
from batchmlx.engine.host.backend import ATTENTION_THREADS, HostBackend, current

# Elements from which a SwiGLU runs on the host (see the module note).
MIN_HOST_ELEMENTS = 1 << 19
# Elements per tile: the tile and its scratch stay in a core's L2 across the passes.
TILE = 1 << 15


def pays(gate: mx.array, x: mx.array) -> bool:
    """Whether `host_swiglu` beats MLX for these operands (float32 only: numpy has no bf16)."""
    return gate.dtype == x.dtype == mx.float32 and gate.size >= MIN_HOST_ELEMENTS


def _swiglu_tile(g: np.ndarray, u: np.ndarray, out: np.ndarray, s: np.ndarray) -> None:
    """out = silu(g) * u = g * u / (1 + exp(-g)) for one tile (any shape), s its scratch.
    exp(-g) -> inf for g < -88 (the caller ignores the overflow): g / inf = -0, silu's limit."""
    np.negative(g, out=s)
    np.exp(s, out=s)
    s += np.float32(1.0)
    np.divide(g, s, out=s)
    np.multiply(s, u, out=out)


def _swiglu_range(g: np.ndarray, u: np.ndarray, out: np.ndarray, lo: int, hi: int) -> None:
    """out[lo:hi] = silu(g) * u over flat arrays, one L2-sized tile at a time."""
    scratch = np.empty(min(TILE, hi - lo), np.float32)
    with np.errstate(over="ignore"):
        for a in range(lo, hi, TILE):
            b = min(hi, a + TILE)
            _swiglu_tile(g[a:b], u[a:b], out[a:b], scratch[: b - a])


def host_swiglu(gate: mx.array, x: mx.array, backend: HostBackend | None = None) -> mx.array:
    """silu(gate) * x (mlx-lm's `swiglu`) for float32 operands of one shape, in numpy."""
    out = mx.zeros(gate.shape, mx.float32)  # a fresh contiguous buffer the result goes into
    mx.eval(gate, x, out)
    g = np.asarray(gate).reshape(-1)
    u = np.asarray(x).reshape(-1)
    o = np.asarray(out).reshape(-1)  # writable view of MLX's buffer
    n = g.size
    if ATTENTION_THREADS > 1 and n >= 2 * TILE:
        half = (n // 2 // TILE) * TILE
        halves = ((0, half), (half, n))
        pool = (backend or current()).pool()
        jobs = [pool.submit(_swiglu_range, g, u, o, lo, hi) for lo, hi in halves]
        for job in jobs:
            job.result()
    else:
        _swiglu_range(g, u, o, 0, n)
    return out


def swiglu_halves(
    gu: np.ndarray, out: np.ndarray | None = None, backend: HostBackend | None = None
) -> np.ndarray:
    """silu(gate) * up of a fused gate-up GEMM's output gu [M, 2I] (gate the first half of each
    row, up the second), as [M, I] float32: rows tile by tile (each tile's passes in L2), the
    halves of a large one on two threads. The host steps' MLP (engine/host/step.py)."""
    return _gated_halves(gu, _swiglu_tile, ops.Activation.SILU, out, backend)


def geglu_halves(
    gu: np.ndarray, out: np.ndarray | None = None, backend: HostBackend | None = None
) -> np.ndarray:
    """gelu_approx(gate) * up (gemma's MLP), as `swiglu_halves`."""
    return _gated_halves(gu, _geglu_tile, ops.Activation.GELU_TANH, out, backend)


# gelu's tanh approximation: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), nn.gelu_approx
_GELU_C = np.float32(math.sqrt(2 / math.pi))
_GELU_K = np.float32(0.044715)


def _geglu_tile(g: np.ndarray, u: np.ndarray, out: np.ndarray, s: np.ndarray) -> None:
    """out = gelu_approx(g) * u for one tile, s its scratch (nn.gelu_approx's formula)."""
    np.multiply(g, g, out=s)
    s *= g
    s *= _GELU_K
    s += g
    s *= _GELU_C
    np.tanh(s, out=s)
    s += np.float32(1.0)
    s *= g
    s *= np.float32(0.5)
    np.multiply(s, u, out=out)


Tile = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]


def _gated_halves(gu: np.ndarray, tile: Tile, act: ops.Activation, out: np.ndarray | None,
                  backend: HostBackend | None) -> np.ndarray:  # fmt: skip
    """out = act(gate) * up of gu's rows: our kernel's `act` where it runs (split by rows
    there, ops.gated), else numpy's `tile`, the row halves of a large one on two threads (a
    row's result is the same)."""
    m, two = gu.shape
    i = two // 2
    if out is None:
        out = np.empty((m, i), np.float32)
    if ops.available() and ops.rows_of(gu) and ops.rows_of(out):
        ops.gated(gu, out, 0, m, act)  # by rows over the GEMMs' workers where large enough
        return out
    rows = max(1, TILE // i)  # rows per tile

    def run(lo: int, hi: int) -> None:
        _gated_rows(gu, out, i, lo, hi, rows, tile)

    if ATTENTION_THREADS > 1 and m * i >= MIN_HOST_ELEMENTS:
        mid = m // 2
        job = (backend or current()).pool().submit(run, mid, m)
        run(0, mid)
        job.result()
    else:
        run(0, m)
    return out


def _gated_rows(
    gu: np.ndarray, out: np.ndarray, i: int, lo: int, hi: int, rows: int, tile: Tile
) -> None:
    """out[lo:hi] = act(gate) * up of gu's rows lo..hi, `rows` rows a tile."""
    scratch = np.empty((min(rows, max(hi - lo, 1)), i), np.float32)
    with np.errstate(over="ignore"):
        for a in range(lo, hi, rows):
            b = min(hi, a + rows)
            tile(gu[a:b, :i], gu[a:b, i:], out[a:b], scratch[: b - a])


def softcap(x: np.ndarray, cap: float) -> None:
    """x -> cap * tanh(x / cap) in place: gemma2's attention scores and logits, as mlx-lm
    computes them (a division, tanh, a product)."""
    x /= np.float32(cap)
    np.tanh(x, out=x)
    x *= np.float32(cap)
