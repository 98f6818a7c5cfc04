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
)))  # fmt: skip


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


def gated(gu: np.ndarray, out: np.ndarray, lo: int, hi: int, act: Activation) -> None:
    """out[lo:hi] = act(gate) * up of gu's rows lo..hi (gu [M, 2I] rows, out [M, I] rows)."""
    lib = library()
    assert lib is not None
    i = out.shape[1]
    lib.ops_gated(
        lo, hi, i, pointer(gu), gu.strides[0] // 4, pointer(out), out.strides[0] // 4, act
    )


def rms_norm(x: np.ndarray, weight: int, eps: float, out: np.ndarray,
             residual: np.ndarray | None = None) -> None:  # fmt: skip
    """out = rms_norm(x) * weight (its address) over x's rows; with `residual`, x += residual
    first (in place), in the same pass."""
    lib = library()
    assert lib is not None
    m, n = x.shape
    r, ldr = (None, 0) if residual is None else (pointer(residual), residual.strides[0] // 4)
    lib.ops_rms_norm(m, n, pointer(x), x.strides[0] // 4, r, ldr, weight, eps, pointer(out),
                     out.strides[0] // 4)  # fmt: skip


def rope(x: np.ndarray, heads: int, head_dim: int, dims: int, traditional: bool,
         cos: np.ndarray, sin: np.ndarray, scaled: int, scale: float) -> np.ndarray:  # fmt: skip
    """x's rows [T, heads x head_dim] rotated (cos, sin [T, dims / 2]), the first `scaled`
    heads times `scale`, as a new [T, heads, head_dim] array."""
    lib = library()
    assert lib is not None
    t = x.shape[0]
    out = np.empty((t, heads, head_dim), np.float32)
    lib.ops_rope(t, heads, head_dim, dims, int(traditional), x.ctypes.data, x.strides[0] // 4,
                 pointer(cos), pointer(sin), pointer(out), scaled, scale)  # fmt: skip
    return out
