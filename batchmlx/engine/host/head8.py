"""The LM head and the embedding of the int8 and q4 host formats: 8-bit weights against bf16
activations, float32 sums, in a kernel of our own (native/head8.c: AVX-512 BF16).

Weights are int8 in groups of 32 along K with a float32 scale per (output channel, group),
w = q * s: a GGUF's Q8_0 table as the file holds it (the converter keeps it as 8-bit affine with
bias -128 s: engine/models/gguf/affine.py), else symmetric rounding per group (s = max|w| / 127).
Half the bytes of a bf16 head, and a Q8_0 file's exact values where bf16 rounds them. The
activations are rounded to bf16 as the bf16 head's are, so only the weights move: an earlier
try at int8 activations too fell to Q8_0's fidelity (benchmarks/RESULTS-fidelity.md). One
arithmetic at every width (head8.c's header): a row's logits are the same bits whatever the
batch or the thread split. The embedding's lookups read the same table (`rows`).

The library ships prebuilt (native/libbatchmlx_head8.so) as q8's does (native_lib.py)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache

import numpy as np

from batchmlx.engine.host import quantized
from batchmlx.engine.host.native_lib import (
    I64,
    INT,
    WIDEN,
    NativeLibrary,
    P,
    Signature,
    cpu_has,
    register,
    widened,
)

GROUP = 32  # K per scale: Q8_0's (fixed in head8.c)
TILE = 16  # output columns per vector: N must be a multiple
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
_GEMM = (INT, INT, P, I64, P, P, P, I64, INT, INT)
LIB = register(NativeLibrary("head8", CPU_FLAGS, ("-mavx512f", "-mavx512bw", "-mavx512vl",
                                                 "-mavx512bf16"), "8-bit head kernel", (
    Signature("head8_to_bf16", (INT, INT, P, I64, P)),
    Signature("head8_gemm", _GEMM),
    Signature("head8_gemm_amx", _GEMM),
    Signature("head8_gemm_pooled", (*_GEMM[:-2], INT, INT, P, INT, INT)),
    Signature("head8_rows", (INT, P, INT, P, P, P)),
    Signature("head8_round", (INT, INT, P, INT, I64, P, P)),
    Signature("head8_amx_init", (), INT),
)))  # fmt: skip
AMX_FLAGS = ("amx_tile", "amx_bf16")
_ROWS_AT_ONCE = 1 << 20  # values rounded at once (`of_float`)
# split over threads from this many multiply-adds (one row of a 135M head: 28 M, ~1-2 ms)
SPLIT_MACS = 4 << 20
CHUNKS = 4  # claims per thread on a runner's workers: a thread the OS holds back leaves its rest


def source_sha() -> str:
    return LIB.source_sha()


def library() -> ctypes.CDLL | None:
    """The kernel, or None where it cannot run here (see native_lib); the reason is logged once."""
    return LIB.load()


@cache
def amx() -> bool:
    """Whether this process computes the head through AMX, at every width: the CPU has
    AMX-BF16 and q8's AMX path runs here (its self-test, and Linux's leave for the tile
    state). Decided once: the two paths' sums differ in their last bits (head8.c)."""
    from batchmlx.engine.host import q8

    lib = library()
    return (lib is not None and cpu_has(AMX_FLAGS) and q8.amx()
            and lib.head8_amx_init() == 0)  # fmt: skip


def available() -> bool:
    return library() is not None


def fits(n: int, k: int) -> bool:
    """Whether the kernel takes a head of this shape (N a multiple of 16, K of 32)."""
    return n % TILE == 0 and k % GROUP == 0


@dataclass(frozen=True)
class Head8Weights:
    """A head's weights [N, K]: `values` int8 [N, K] in the kernel's layout ([N/16][K/2][16][2]),
    `scales` float32 [N/16 * K/32 * 16] ([N/16][K/32][16]). 9 bits a weight in all (Q8_0's
    file: 8.5; bf16: 16)."""

    values: np.ndarray
    scales: np.ndarray
    n: int
    k: int

    @classmethod
    def pack(cls, q: np.ndarray, s: np.ndarray) -> Head8Weights:
        """q[N, K] int8 (|q| <= 127) and s[N, K / 32] float32 (w = q * s) in row order."""
        n, k = q.shape
        v = np.asarray(q, np.int8).reshape(n // TILE, TILE, k // 2, 2).transpose(0, 2, 1, 3)
        sc = np.asarray(s, np.float32).reshape(n // TILE, TILE, k // GROUP).transpose(0, 2, 1)
        return cls(np.ascontiguousarray(v).reshape(n, k), np.ascontiguousarray(sc).ravel(), n, k)

    @classmethod
    def of_float(cls, w: np.ndarray) -> Head8Weights:
        """Symmetric rounding per group of 32 (`round_groups`'s bits). w float32, float16 or
        bf16 as its bits (uint16), read as it lies by head8.c's `head8_round` where it runs
        (straight into the layout), else in numpy a few rows at a time."""
        n, k = w.shape
        lib = library()
        code = WIDEN.get(w.dtype)
        if lib is not None and code is not None and fits(n, k) and w.strides[1] == w.itemsize:
            out = cls(np.empty((n, k), np.int8), np.empty(n * (k // GROUP), np.float32), n, k)
            lib.head8_round(n, k, w.ctypes.data, code, w.strides[0] // w.itemsize,
                            out.values.ctypes.data, out.scales.ctypes.data)  # fmt: skip
            return out
        q = np.empty((n, k), np.int8)
        s = np.empty((n, k // GROUP), np.float32)
        step = chunk_rows(k)
        for r in range(0, n, step):
            q[r : r + step], s[r : r + step] = round_groups(widened(w[r : r + step]))
        return cls.pack(q, s)

    @classmethod
    def of_q8_0(cls, weight: np.ndarray, scales: np.ndarray,
                biases: np.ndarray) -> Head8Weights | None:  # fmt: skip
        """A Q8_0 table as the GGUF converter keeps it (8-bit affine, q + 128 with bias -128 s),
        its values and scales exactly; None when it is not one (another 8-bit affine)."""
        s = np.asarray(scales, np.float32)
        if not np.array_equal(np.asarray(biases, np.float32), s * np.float32(-128)):
            return None
        u = quantized.unpack(np.asarray(weight), 8)
        q = (u.astype(np.int16) - 128).astype(np.int8)
        if q.min(initial=0) < -127:  # (Q8_0 never writes -128: |q| <= 127 in bf16 exactly)
            return None
        return cls.pack(q, s)

    @classmethod
    def adopt(cls, values: np.ndarray, scales: np.ndarray, n: int, k: int) -> Head8Weights | None:
        """Arrays `pack` made earlier (a weights cache), or None when their sizes do not fit."""
        v = np.asarray(values).view(np.int8).reshape(-1)
        s = np.asarray(scales).view(np.float32).reshape(-1)
        if v.size != n * k or s.size != n * (k // GROUP):
            return None
        return cls(v.reshape(n, k), s, n, k)

    def unpacked(self) -> tuple[np.ndarray, np.ndarray]:
        """q[N, K] and s[N, K / 32] back in row order (tests, references)."""
        n, k = self.n, self.k
        q = self.values.reshape(n // TILE, k // 2, TILE, 2).transpose(0, 2, 1, 3).reshape(n, k)
        s = self.scales.reshape(n // TILE, k // GROUP, TILE).transpose(0, 2, 1).reshape(n, -1)
        return q, s


def chunk_rows(k: int) -> int:
    """Rows rounded at once: a few MB of temporaries, not several copies of a whole table."""
    return max(1, _ROWS_AT_ONCE // k)


def round_groups(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [R, K] -> q int8 [R, K] and s float32 [R, K / 32]: s = max|w| / 127 per
    group of 32, q = round(w / s). A group holding NaN or infinity keeps it in its scale (NaN:
    the logits show it, as a float head's would) and quantizes to zeros (casting NaN to int8
    is undefined)."""
    rows, k = w.shape
    g = w.reshape(rows, k // GROUP, GROUP)
    s = np.abs(g).max(axis=2) * np.float32(1.0 / 127.0)
    ok = np.isfinite(s)
    s[~ok] = np.nan
    inv = np.divide(np.float32(1.0), s, out=np.zeros_like(s), where=ok & (s > 0))
    with np.errstate(invalid="ignore"):
        t = np.where(ok[:, :, None], g * inv[:, :, None], 0)
    return np.clip(np.rint(t), -127, 127).astype(np.int8).reshape(rows, k), s


def _lib() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError("8-bit head kernel unavailable (see the log)")
    return lib


def rows(w: Head8Weights, ids: np.ndarray) -> np.ndarray:
    """The table's rows `ids`, dequantized: float32 [len(ids), K] (an embedding's lookup)."""
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    out = np.empty((ids.size, w.k), np.float32)
    _lib().head8_rows(ids.size, ids.ctypes.data, w.k, w.values.ctypes.data,
                      w.scales.ctypes.data, out.ctypes.data)  # fmt: skip
    return out


def to_bf16(x: np.ndarray, rows: int | None = None) -> np.ndarray:
    """float32 rows [M, K] (unit column stride) -> their bf16 bits (uint16), nearest even;
    `rows`: that many rows (>= M), the ones past M zero (AMX's padding)."""
    m, k = x.shape
    out = np.empty((m, k), np.uint16) if rows is None else np.zeros((rows, k), np.uint16)
    _lib().head8_to_bf16(m, k, x.ctypes.data, x.strides[0] // 4, out.ctypes.data)
    return out


def matmul(x: np.ndarray, w: Head8Weights, out: np.ndarray, *, threads: int = 1,
           pool: Callable[[], ThreadPoolExecutor] | None = None, runner: int | None = None,
           use_amx: bool | None = None) -> None:  # fmt: skip
    """out[M, N] = x[M, K] . w^T, x float32 rows (rounded to bf16 here) or their bf16 bits
    (uint16), out float32 C-contiguous. Through AMX where `amx()` holds (`use_amx` forces
    either: tests), at every M. Split by columns over `threads` when large enough: on
    `runner`'s workers (q8.pool_runner: the GEMMs') in one C call, else this thread and
    `pool()`'s. A row's logits are the same bits however it is split."""
    lib = _lib()
    if use_amx is None:
        use_amx = amx()
    elif use_amx and not amx():  # (also Linux's leave for the tile state, asked there)
        raise RuntimeError("the 8-bit head kernel's AMX path does not run here")
    m = x.shape[0]
    if m == 0:  # (a step whose rows need no logits)
        return
    rows = None  # AMX's tiles: 16 rows from 16, at least 2 (head8.c)
    if use_amx and (m > 16 or m == 1):
        rows = 2 if m == 1 else -(-m // 16) * 16
    if x.dtype == np.uint16:
        if rows is None:
            x = np.ascontiguousarray(x)
        else:
            bits = np.zeros((rows, w.k), np.uint16)
            bits[:m] = x
            x = bits
    else:
        xf = np.asarray(x, np.float32)
        x = to_bf16(xf if xf.strides[1] == 4 else np.ascontiguousarray(xf), rows)
    args = (m, w.k, x.ctypes.data, x.strides[0] // 2, w.values.ctypes.data, w.scales.ctypes.data,
            out.ctypes.data, out.strides[0] // 4)  # fmt: skip
    gemm = lib.head8_gemm_amx if use_amx else lib.head8_gemm
    if threads <= 1 or (pool is None and runner is None) or m * w.n * w.k < SPLIT_MACS:
        gemm(*args, 0, w.n)
        return
    if runner is not None:  # units of 64 columns, CHUNKS claims a thread (as q8's GEMMs)
        units = -(-w.n // 64)
        lib.head8_gemm_pooled(*args, w.n, int(use_amx), runner, threads,
                              max(1, units // (CHUNKS * threads)))  # fmt: skip
        return
    # equal column spans, one a thread, in blocks of 64 columns (the kernels' widest): the
    # call is one a step
    bounds = [w.n * i // threads // 64 * 64 for i in range(threads)] + [w.n]
    executor = pool()
    futures = [executor.submit(gemm, *args, a, b)
               for a, b in zip(bounds[1:-1], bounds[2:], strict=True)]  # fmt: skip
    gemm(*args, bounds[0], bounds[1])
    for f in futures:
        f.result()
