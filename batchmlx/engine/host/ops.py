"""The host step's elementwise passes in a kernel of our own (native/ops.c, AVX-512F): a gated
MLP's activation of the fused gate-up GEMM's rows, RMSNorm with the residual add before it,
and RoPE with the queries' scale.

Why: at a decode step's width each of these was a dozen numpy calls of a few microseconds
(30 layers x ~12 calls a step at 135M), and at width 64 SwiGLU's five numpy passes over
64 x 1,536 per layer were ~8% of the step. Here each is one pass per row and one call. Every
row is computed alone in a fixed order, so a row's result does not depend on the batch (the
host step's batch invariance, docs/engine.md). Where the library cannot run (no AVX-512, another
OS), `available()` is False and the callers keep their numpy forms (elementwise.py, rope.py,
step.py), which agree with these closely (tests/engine/test_host_ops.py), not bit for bit: the
exponential is our own and a norm sums its squares in another order.
"""

from __future__ import annotations

import ctypes
import enum

import numpy as np

from batchmlx.engine.host import backend, q8
from batchmlx.engine.host.native_lib import (
    FLOAT,
    I64,
    INT,
    NativeLibrary,
    P,
    Signature,
    pointer,
    register,
)

CPU_FLAGS = ("avx512f",)
LIB = register(NativeLibrary("ops", CPU_FLAGS, ("-mavx512f",), "host step's elementwise kernel", (
    Signature("ops_gated", (INT, INT, INT, P, I64, P, I64, INT)),
    Signature("ops_rms_norm", (INT, INT, P, I64, P, I64, P, FLOAT, P, I64)),
    Signature("ops_rope", (INT, INT, INT, INT, INT, P, I64, P, P, P, INT, FLOAT)),
    Signature("ops_gated_pooled", (INT, INT, P, I64, P, I64, INT, P, INT)),
    Signature("ops_rms_norm_pooled", (INT, INT, P, I64, P, I64, P, FLOAT, P, I64, P, INT)),
    Signature("ops_rope_pooled", (INT, INT, INT, INT, INT, P, I64, P, P, P, INT, FLOAT, P, INT)),
)))  # fmt: skip
# from this many elements a pass goes by rows to the GEMMs' workers (q8.pool_runner: a hand-off
# of a microsecond or two; one row of a 135M layer's gated pass is ~0.5 us)
POOL_ELEMENTS = 1 << 14


class Activation(enum.IntEnum):
    """A gated MLP's activation, as ops_gated takes it."""

    SILU = 0
    GELU_TANH = 1


def library() -> ctypes.CDLL | None:
    """The kernel, or None where it cannot run here (see native_lib); the reason is logged once."""
    return LIB.load()


def available() -> bool:
    return library() is not None


def rows_of(x: np.ndarray) -> bool:
    """Whether x is float32 rows the kernels read as they are: [M, N], elements adjacent."""
    return x.ndim == 2 and x.dtype == np.float32 and x.strides[1] == 4 and x.strides[0] > 0


def _pool(rows: int, elements: int) -> tuple[int, int] | None:
    """(runner, threads) where a pass of `rows` rows, `elements` in all, goes to the GEMMs'
    workers; None: this thread alone."""
    if rows < 2 or elements < POOL_ELEMENTS:
        return None
    runner = q8.pool_runner()
    threads = backend.current().threads.or_cpus()
    return None if runner is None or threads < 2 else (runner, threads)


def gated(gu: np.ndarray, out: np.ndarray, lo: int, hi: int, act: Activation) -> None:
    """out[lo:hi] = act(gate) * up of gu's rows lo..hi (gu [M, 2I] rows, out [M, I] rows);
    all of them (lo 0, hi M) by rows over the GEMMs' workers when large enough."""
    lib = library()
    assert lib is not None
    i = out.shape[1]
    ldg, ldo = gu.strides[0] // 4, out.strides[0] // 4
    pool = _pool(hi - lo, (hi - lo) * i) if (lo, hi) == (0, out.shape[0]) else None
    if pool is not None:
        lib.ops_gated_pooled(hi, i, pointer(gu), ldg, pointer(out), ldo, act, *pool)
        return
    lib.ops_gated(lo, hi, i, pointer(gu), ldg, pointer(out), ldo, act)


def rms_norm(x: np.ndarray, weight: int, eps: float, out: np.ndarray,
             residual: np.ndarray | None = None) -> None:  # fmt: skip
    """out = rms_norm(x) * weight (its address) over x's rows; with `residual`, x += residual
    first (in place), in the same pass."""
    lib = library()
    assert lib is not None
    m, n = x.shape
    r, ldr = (None, 0) if residual is None else (pointer(residual), residual.strides[0] // 4)
    args = (m, n, pointer(x), x.strides[0] // 4, r, ldr, weight, eps, pointer(out),
            out.strides[0] // 4)  # fmt: skip
    pool = _pool(m, m * n)
    if pool is not None:
        lib.ops_rms_norm_pooled(*args, *pool)
        return
    lib.ops_rms_norm(*args)


def rope(x: np.ndarray, heads: int, head_dim: int, dims: int, traditional: bool,
         cos: np.ndarray, sin: np.ndarray, scaled: int, scale: float) -> np.ndarray:  # fmt: skip
    """x's rows [T, heads x head_dim] rotated (cos, sin [T, dims / 2]), the first `scaled`
    heads times `scale`, as a new [T, heads, head_dim] array."""
    lib = library()
    assert lib is not None
    t = x.shape[0]
    out = np.empty((t, heads, head_dim), np.float32)
    args = (t, heads, head_dim, dims, int(traditional), x.ctypes.data, x.strides[0] // 4,
            pointer(cos), pointer(sin), pointer(out), scaled, scale)  # fmt: skip
    pool = _pool(t, t * heads * head_dim)
    if pool is not None:
        lib.ops_rope_pooled(*args, *pool)
    else:
        lib.ops_rope(*args)
    return out
