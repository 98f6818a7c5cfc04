"""The `q4` host format's GEMM: a 4-bit GGUF's weights kept in their own bits, 4 in memory and
in the GEMM, against int8 activations, in a kernel of our own (native/q4.c: AVX-512 VNNI, and
AMX from AMX_ROWS rows where q8's probe finds it usable).

Weights are affine in groups of 32 along K, w = s * q + b with q in 0..15 and a float32 scale
and bias per (output channel, group): what the GGUF converter keeps of Q4_0 (b = -8s), Q4_1 and
Q4_K (its 32-value sub-blocks), exactly (engine/models/gguf/affine.py). A layer's input is
quantized per (token, group of 32) to int8 as q8's is, and each group's two exact integer sums
(the product with q, and the activations' own sum) are rescaled and summed in group order:
batch-invariant by construction, as q8 (q4.c's header).

A GEMM is one C call, as q8's: the activations quantized (native/grouped.h, q8's code), then the
columns split in chunks over this thread and the library's own pthread pool (native/pool.h,
q8's code; a pool per library) from SPLIT_MACS multiply-adds, one-row decode GEMMs included.
Until 2026-12-07 the split went through a Python ThreadPoolExecutor (~30-50 us a hand-off) and
nothing under 4M multiply-adds split (benchmarks/RESULTS-host-ops.md, "q4's GEMMs on the pool").

The library ships prebuilt (native/libbatchmlx_q4.so) as q8's does (native_lib.py)."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from batchmlx.engine.host import q8, quantized
from batchmlx.engine.host.native_lib import (
    I64,
    INT,
    NativeLibrary,
    P,
    Signature,
    pointer,
    register,
)

GROUP = 32  # K per scale and bias: the GGUF types' (and the kernel's: fixed in q4.c)
BITS = 4
TILE = 16  # output columns per vector: N must be a multiple
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
# -pthread: its pool's threads (native/pool.h, q8's too; glibc < 2.34 keeps them in libpthread)
TARGET_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-pthread")
_GEMM = (INT, INT, INT, P, P, P, P, P, P, P, INT, INT)
LIB = register(NativeLibrary("q4", CPU_FLAGS, TARGET_FLAGS, "grouped 4-bit kernel", (
    Signature("q4_quantize", (INT, INT, P, I64, P, P, P, INT)),
    Signature("q4_gemm", _GEMM),
    Signature("q4_gemm_amx", _GEMM),
    Signature("q4_matmul", (INT, INT, INT, P, I64, *[P] * 7, INT, INT, INT)),
    Signature("q4_pool_workers", (), INT),
    Signature("q4_pool_helped", (), I64),
)))  # fmt: skip
# a GEMM of at least this many multiply-adds is split over threads by columns, in one C call
# (q4_matmul over native/pool.h, as q8's); through a Python thread pool the hand-off was
# ~30-50 us and this was 4 << 20, so no one-row decode GEMM split
SPLIT_MACS = q8.SPLIT_MACS
# from this many rows a GEMM goes through AMX where it runs (the same bits as VNNI): below it
# the panel's unpacking costs more than AMX saves (one layer, 1 thread, AMX / VNNI time: 135M
# 1.22 / 0.84 / 0.66 at 4 / 8 / 16 rows, 8B shape 1.48 / 1.00 / 0.66; 2-core Xeon, load 5)
AMX_ROWS = 8


def source_sha() -> str:
    return LIB.source_sha()


def library() -> ctypes.CDLL | None:
    """The kernel, or None where it cannot run here (see native_lib); the reason is logged once."""
    return LIB.load()


def available() -> bool:
    return library() is not None


def amx() -> bool:
    """Whether the AMX path runs here: q8's verdict (its self-test in a child process, and
    Linux's grant of the tile state, which holds for the whole process)."""
    return available() and q8.amx()


def fits(n: int, k: int) -> bool:
    """Whether the kernel takes a GEMM of this shape (N a multiple of 16, K of 32)."""
    return n % TILE == 0 and k % GROUP == 0


@dataclass(frozen=True)
class Q4Weights:
    """One GEMM's weights [N, K] in one byte buffer: the values in the kernel's layout
    ([N/16][K/8][16][4] bytes, each byte two values of one column: k in its low nibble, k + 4
    in its high one, for k in the first half of each 8), then the scales, then the biases,
    both float32 [N/16][ng][16]. 6 bits a weight in all (Q4_K's file: 4.5, Q4_0's: 4.5)."""

    buffer: np.ndarray  # uint8, C-contiguous
    n: int
    k: int

    @staticmethod
    def nbytes(n: int, k: int) -> int:
        return n * k // 2 + 8 * (k // GROUP) * n

    @cached_property
    def packed(self) -> np.ndarray:
        return self.buffer[: self.n * self.k // 2]

    @cached_property
    def scales(self) -> np.ndarray:
        at = self.n * self.k // 2
        return self.buffer[at : at + 4 * (self.k // GROUP) * self.n].view(np.float32)

    @cached_property
    def biases(self) -> np.ndarray:
        at = self.n * self.k // 2 + 4 * (self.k // GROUP) * self.n
        return self.buffer[at:].view(np.float32)

    @cached_property
    def addresses(self) -> tuple[int, int, int]:
        return self.packed.ctypes.data, self.scales.ctypes.data, self.biases.ctypes.data

    @classmethod
    def pack(cls, q: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> Q4Weights:
        """q[N, K] uint8 values in 0..15, scales and biases [N, K / 32] (w = s * q + b)."""
        n, k = q.shape
        out = cls(np.empty(cls.nbytes(n, k), np.uint8), n, k)
        # [N/16, 16, K/8, 2, 4] -> [N/16, K/8, 16, 4] bytes, the halves in the nibbles
        v = q.reshape(n // TILE, TILE, k // 8, 2, 4).transpose(0, 2, 1, 3, 4)
        out.packed[:] = (v[:, :, :, 0, :] | (v[:, :, :, 1, :] << 4)).ravel()
        out.scales[:] = _by_tile(np.asarray(scales, np.float32))
        out.biases[:] = _by_tile(np.asarray(biases, np.float32))
        return out

    @classmethod
    def from_affine(cls, parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> Q4Weights:
        """Layers in MLX's 4-bit affine format (weight uint32 [R, K / 8], scales and biases
        [R, K / 32]; group 32), concatenated along N, as one GEMM's weights."""
        q = np.concatenate([quantized.unpack(np.asarray(w), BITS) for w, _, _ in parts])
        s = np.concatenate([np.asarray(s, np.float32) for _, s, _ in parts])
        b = np.concatenate([np.asarray(b, np.float32) for _, _, b in parts])
        return cls.pack(q, s, b)

    @classmethod
    def adopt(cls, buffer: np.ndarray, n: int, k: int) -> Q4Weights | None:
        """Bytes `pack` made earlier (a weights cache), or None when their size does not fit."""
        buffer = np.asarray(buffer).reshape(-1).view(np.uint8)
        return cls(buffer, n, k) if buffer.nbytes == cls.nbytes(n, k) else None

    def values(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """q[N, K], scales and biases [N, K / 32] back in row order (tests, references)."""
        n, k, ng = self.n, self.k, self.k // GROUP
        b = self.packed.reshape(n // TILE, k // 8, TILE, 4)
        v = np.stack([b & 0x0F, b >> 4], axis=3)  # [N/16, K/8, 16, 2, 4]
        q = v.transpose(0, 2, 1, 3, 4).reshape(n, k)

        def rows(a: np.ndarray) -> np.ndarray:
            return a.reshape(n // TILE, ng, TILE).transpose(0, 2, 1).reshape(n, ng)

        return q, rows(self.scales), rows(self.biases)


def _by_tile(a: np.ndarray) -> np.ndarray:
    """[N, ng] -> [N/16][ng][16], flat: each tile of 16 columns' groups in a row."""
    n, ng = a.shape
    return a.reshape(n // TILE, TILE, ng).transpose(0, 2, 1).ravel()


def quantize(x: np.ndarray, tiles: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x[M, K] float32 rows (unit column stride) -> int8 values [M, K], scales and the
    values' sums per group [M, K / 32], as the kernel computes them (q8's quantization).
    `tiles`: in AMX's layout instead (q4.c), M rounded up to 16 (flat arrays)."""
    lib = library()
    if lib is None:
        raise RuntimeError("grouped 4-bit kernel unavailable (see the log)")
    m, k = x.shape
    rows = -(-m // 16) * 16 if tiles else m
    xq = np.empty((rows, k), np.int8)
    xs = np.empty((rows, k // GROUP), np.float32)
    xsum = np.empty((rows, k // GROUP), np.float32)
    lib.q4_quantize(m, k, x.ctypes.data, x.strides[0] // 4, xq.ctypes.data, xs.ctypes.data,
                    xsum.ctypes.data, int(tiles))  # fmt: skip
    return xq, xs, xsum


def matmul(x: np.ndarray, w: Q4Weights, out: np.ndarray, *, threads: int = 1,
           use_amx: bool | None = None) -> None:  # fmt: skip
    """out[M, N] = x[M, K] . w^T, x float32 rows (any row stride, unit column stride), out
    float32 C-contiguous. Split by columns over `threads` (this thread and q4.c's pool) when it
    is large enough, through AMX from AMX_ROWS rows where it runs (`use_amx` forces either
    way): a row's result is the same however it is split and whichever path computes it."""
    lib = library()
    if lib is None:
        raise RuntimeError("grouped 4-bit kernel unavailable (see the log)")
    if x.dtype != np.float32 or x.strides[1] != 4:
        x = np.ascontiguousarray(x, dtype=np.float32)
    m = x.shape[0]
    if use_amx is None:
        use_amx = m >= AMX_ROWS and amx()
    elif use_amx and not amx():
        raise RuntimeError("the grouped 4-bit kernel's AMX path does not run here")
    # AMX reads its activations, scales and sums as tiles of 16 rows: the last one rounded up
    (xq, xs, xsum), _held = q8.scratch(-(-m // 16) * 16 if use_amx else m, w.k, sums=True)
    if m * w.n * w.k < SPLIT_MACS:
        threads = 1
    # the columns split as q8's (one run a thread: the reason at q8.CHUNKS); one 135M layer at
    # 2 threads, 4 runs a thread -> 1: 8 rows 0.26 -> 0.20-0.22 ms, 64 rows 1.16-1.25 -> 0.92
    lib.q4_matmul(m, w.n, w.k, pointer(x), x.strides[0] // 4, xq, xs, xsum, *w.addresses,
                  pointer(out), int(use_amx), max(1, threads),
                  q8.column_chunk(w.n, threads, use_amx))  # fmt: skip


def pool_workers() -> tuple[int, int]:
    """Threads q4.c's pool has started (at the first split GEMM), and the columns they have
    computed since."""
    lib = library()
    return (0, 0) if lib is None else (lib.q4_pool_workers(), lib.q4_pool_helped())
