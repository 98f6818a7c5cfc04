"""oneDNN's matmul through its C API (ctypes): the GEMMs of the host weight formats
(host_linear.py) on MLX's CPU backend.

MLX 0.32's CPU kernels for bf16 and quantized weights run at 2.5-6 GFLOP/s, so on a Linux CPU
MLX's only fast path is float32 through a fast BLAS, at 4 bytes a weight. oneDNN chooses its
kernels at run time by CPU features (AVX-512 BF16 and VNNI, AVX2; not by vendor, so AMD hosts
get them too): bf16 x bf16 and s8 x s8 products accumulate in float32 / int32 and write float32.

The library comes from the `onednn-cpu-gomp` wheel (oneDNN 3.2, GNU OpenMP; a dependency on Linux
x86-64). `open_library` finds it under the Python prefixes (or at the path BATCHMLX_ONEDNN_LIB
gives, through HostSettings) and says what to install when it is missing; the HostBackend
(backend.py) opens it once and keeps it. Its OpenMP team follows the engine's thread count (the
backend's ComputeThreads, which the thread governor moves with the load), set on the calling
thread.
"""

from __future__ import annotations

import ctypes
import enum
import glob
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from batchmlx.engine.host.fast_blas import python_prefixes
from batchmlx.engine.host.threads import ComputeThreads, set_openmp_defaults

INSTALL_HINT = (
    "the host weight formats need oneDNN: pip install onednn-cpu-gomp (Linux x86-64; a "
    "dependency of batchmlx there; it needs the GNU OpenMP runtime libgomp.so.1)"
)
_LIB_NAMES = ("libdnnl.so.3.2", "libdnnl.so.3*", "libdnnl.so")
_ARG_SRC, _ARG_DST, _ARG_WEIGHTS, _ARG_SCALES = 1, 17, 33, 4096
_TAG_ANY, _QUERY_WEIGHTS_MD = 1, 131  # dnnl_format_tag_any, dnnl_query_weights_md
_QUERY_IMPL_INFO = 8  # dnnl_query_impl_info_str: the kernel a primitive descriptor chose
_p = ctypes.c_void_p
# Primitives kept (one per shape and type seen); past this many they are all dropped and remade
MAX_PRIMITIVES = 2048
# A float matmul of fewer rows than this runs with the kernel oneDNN picks for this many (zero
# rows added below where it would pick another), so that a row's result never depends on how
# many rows share its GEMM (batch invariance): with AMX, oneDNN 3.2 takes its AVX-512 BF16
# kernel, which pairs the products in another order, for the 49,152 x 576 head at M <= 2 and a
# 12,288 x 576 one at M <= 8; each of its kernels alone gives every row the same bits at every
# M (checked 1-1,000 rows, 1 and 2 threads, tests/engine/test_invariance.py)
CANONICAL_ROWS = 64


class OneDNNUnavailable(RuntimeError):
    """A host weight format asked for where it cannot run (no oneDNN, or not MLX's CPU)."""


class DataType(enum.IntEnum):
    """dnnl_data_type_t values used here."""

    BF16 = 2
    F32 = 3  # (also the float32 host format's weights)
    S8 = 5

    @property
    def numpy(self) -> type:
        """The numpy type holding it (bf16 as its bits)."""
        return {DataType.BF16: np.uint16, DataType.F32: np.float32, DataType.S8: np.int8}[self]


@dataclass(frozen=True, eq=False)
class Packed:
    """Weights [N, K] in oneDNN's own layout for matmuls of their shape (OneDNN.pack)."""

    md: ctypes.c_void_p | None  # its memory descriptor (owned); None: plain float32 rows
    # that numpy's BLAS reads (host_linear's float32 format)
    buffer: np.ndarray  # the packed bytes
    n: int
    k: int
    dt: DataType
    scaled: bool  # per-output-channel scales are applied (int8)


class _Version(ctypes.Structure):  # dnnl_version_t
    _fields_ = [("major", ctypes.c_int), ("minor", ctypes.c_int), ("patch", ctypes.c_int),
                ("hash", ctypes.c_char_p), ("cpu_runtime", ctypes.c_uint),
                ("gpu_runtime", ctypes.c_uint)]  # fmt: skip


class _ExecArg(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_int), ("memory", _p)]


class _Local(threading.local):
    threads = 0  # the OpenMP team size last set on this thread (0: never)


class OneDNN:
    """x[M, K] . w[N, K]^T -> float32 out[M, N], optionally times per-output-channel scales.
    A primitive per (M, N, K, types) is made on first use and kept (layer shapes, decode widths
    and prompt chunk sizes recur); its memory objects are re-pointed at each call's buffers."""

    def __init__(self, path: str, threads: ComputeThreads | None = None) -> None:
        self.path = path
        # the engine's thread count, read per call so the governor's changes apply
        self.threads = ComputeThreads() if threads is None else threads
        lib = self.lib = ctypes.CDLL(path)
        lib.dnnl_primitive_execute.argtypes = [_p, _p, ctypes.c_int, _p]
        lib.dnnl_memory_set_data_handle.argtypes = [_p, _p]
        lib.dnnl_stream_wait.argtypes = [_p]
        lib.dnnl_memory_create.argtypes = [_p, _p, _p, _p]
        lib.dnnl_matmul_primitive_desc_create.argtypes = [_p, _p, _p, _p, _p, _p, _p]
        lib.dnnl_primitive_create.argtypes = [_p, _p]
        lib.dnnl_primitive_attr_set_scales_mask.argtypes = [_p, ctypes.c_int, ctypes.c_int]
        lib.dnnl_stream_create.argtypes = [_p, _p, ctypes.c_uint]
        lib.dnnl_primitive_destroy.argtypes = lib.dnnl_memory_destroy.argtypes = [_p]
        lib.dnnl_primitive_desc_query.argtypes = [_p, ctypes.c_int, ctypes.c_int, _p]
        lib.dnnl_primitive_desc_query_md.restype = _p
        lib.dnnl_primitive_desc_query_md.argtypes = [_p, ctypes.c_int, ctypes.c_int]
        lib.dnnl_memory_desc_get_size.restype = ctypes.c_size_t
        lib.dnnl_memory_desc_get_size.argtypes = [_p]
        lib.dnnl_memory_desc_clone.argtypes = [_p, _p]
        lib.dnnl_primitive_desc_destroy.argtypes = [_p]
        lib.dnnl_memory_desc_destroy.argtypes = [_p]
        lib.dnnl_primitive_attr_destroy.argtypes = [_p]
        lib.dnnl_version.restype = ctypes.POINTER(_Version)
        lib.dnnl_memory_desc_create_with_tag.argtypes = [_p, ctypes.c_int, _p, ctypes.c_int,
                                                         ctypes.c_int]  # fmt: skip
        lib.dnnl_reorder_primitive_desc_create.argtypes = [_p, _p, _p, _p, _p, _p]
        self.engine, self.stream = _p(), _p()
        self._ok(lib.dnnl_engine_create(ctypes.byref(self.engine), 1, ctypes.c_size_t(0)))
        self._ok(lib.dnnl_stream_create(ctypes.byref(self.stream), self.engine, 1))
        self._prims: dict[tuple, tuple] = {}
        self._rows: dict[tuple, int] = {}  # (M, weights' shape and type) -> the M it runs as
        self._supported: dict[tuple[int, bool], bool] = {}
        self._brgemm: dict[DataType, bool] = {}
        self._lock = threading.Lock()
        self._local = _Local()
        self._omp_set = _omp_setter()

    @staticmethod
    def _ok(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"oneDNN call failed (status {status})")

    def _md(self, dims: tuple[int, ...], dt: int, strides: tuple[int, ...]) -> _p:
        md = _p()
        d = (ctypes.c_int64 * 12)(*dims)
        s = (ctypes.c_int64 * 12)(*strides)
        self._ok(self.lib.dnnl_memory_desc_create_with_strides(
            ctypes.byref(md), len(dims), d, dt, s))  # fmt: skip
        return md

    def _matmul_pd(self, m: int, n: int, k: int, dt: DataType, scaled: bool, wts: _p) -> _p:
        lib = self.lib
        src = self._md((m, k), dt, (k, 1))
        dst = self._md((m, n), DataType.F32, (n, 1))
        attr = _p()
        self._ok(lib.dnnl_primitive_attr_create(ctypes.byref(attr)))
        if scaled:
            self._ok(lib.dnnl_primitive_attr_set_scales_mask(attr, _ARG_WEIGHTS, 1 << 1))
        pd = _p()
        self._ok(lib.dnnl_matmul_primitive_desc_create(
            ctypes.byref(pd), self.engine, src, wts, None, dst, attr))  # fmt: skip
        return pd

    def _packed_md(self, n: int, k: int, dt: DataType, scaled: bool) -> _p:
        """The layout oneDNN's matmul kernels read best for weights [N, K] (blocked, chosen by
        version and CPU; the same for every M, checked at M 1-2048): an owned descriptor."""
        lib = self.lib
        anyfmt, dims = _p(), (ctypes.c_int64 * 12)(k, n)
        self._ok(lib.dnnl_memory_desc_create_with_tag(ctypes.byref(anyfmt), 2, dims, dt, _TAG_ANY))
        pd = self._matmul_pd(1, n, k, dt, scaled, anyfmt)
        md = _p()
        self._ok(lib.dnnl_memory_desc_clone(ctypes.byref(md), lib.dnnl_primitive_desc_query_md(
            pd, _QUERY_WEIGHTS_MD, 0)))  # fmt: skip
        lib.dnnl_primitive_desc_destroy(pd)
        return md

    def pack(self, w: np.ndarray, dt: DataType, *, scaled: bool) -> Packed:
        """w[N, K] (C-contiguous, of type `dt`) reordered once into that layout: plain weights
        cost every GEMM a repacking of them, ~40% of a decode step's GEMM time."""
        lib = self.lib
        n, k = w.shape
        md = self._packed_md(n, k, dt, scaled)
        buf = np.zeros(lib.dnnl_memory_desc_get_size(md), np.uint8)
        plain = self._md((k, n), dt, (1, k))  # W[N, K] row-major is [K, N], strides (1, K)
        rpd, prim = _p(), _p()
        self._ok(lib.dnnl_reorder_primitive_desc_create(
            ctypes.byref(rpd), plain, self.engine, md, self.engine, None))  # fmt: skip
        self._ok(lib.dnnl_primitive_create(ctypes.byref(prim), rpd))
        a, b = _p(), _p()
        self._ok(lib.dnnl_memory_create(ctypes.byref(a), plain, self.engine, _p(w.ctypes.data)))
        self._ok(lib.dnnl_memory_create(ctypes.byref(b), md, self.engine, _p(buf.ctypes.data)))
        args = (_ExecArg * 2)(_ExecArg(_ARG_SRC, a), _ExecArg(_ARG_DST, b))
        with self._lock:
            self._ok(lib.dnnl_primitive_execute(prim, self.stream, 2, args))
            self._ok(lib.dnnl_stream_wait(self.stream))
        for mem in (a, b):
            lib.dnnl_memory_destroy(mem)
        lib.dnnl_primitive_destroy(prim)
        lib.dnnl_primitive_desc_destroy(rpd)
        return Packed(md, buf, n, k, dt, scaled)

    def adopt(self, buffer: np.ndarray, n: int, k: int, dt: DataType, *,
              scaled: bool) -> Packed | None:  # fmt: skip
        """Bytes `pack` made earlier (a weights cache) taken as they are; None when this
        library would lay the weights out in another size (pack them again)."""
        md = self._packed_md(n, k, dt, scaled)
        if self.lib.dnnl_memory_desc_get_size(md) != buffer.nbytes:
            self.lib.dnnl_memory_desc_destroy(md)
            return None
        return Packed(md, buffer, n, k, dt, scaled)

    def supports(self, dt: DataType, *, scaled: bool = False) -> bool:
        """Whether this library has a matmul for weights of type `dt` on this CPU: oneDNN 3.2's
        bf16 kernels need AVX-512 (an AVX2-only CPU answers "unimplemented"); its s8 ones run
        on AVX2 but are exact only with VNNI (`_exact_s8`). Asked once per type."""
        key = (int(dt), scaled)
        if key not in self._supported:
            anyfmt, dims = _p(), (ctypes.c_int64 * 12)(64, 64)
            self._ok(self.lib.dnnl_memory_desc_create_with_tag(ctypes.byref(anyfmt), 2, dims, dt,
                                                               _TAG_ANY))  # fmt: skip
            try:
                pd = self._matmul_pd(1, 64, 64, dt, scaled, anyfmt)
            except RuntimeError:
                self._supported[key] = False
            else:
                self.lib.dnnl_primitive_desc_destroy(pd)
                self._supported[key] = dt is not DataType.S8 or self._exact_s8()
            self.lib.dnnl_memory_desc_destroy(anyfmt)
        return self._supported[key]

    def brgemm(self, dt: DataType) -> bool:
        """Whether this library's matmul for `dt` is one of its brgemm kernels (AVX-512 and
        up), whose rows come out the same at every M (`rows_for`); the float32 host format
        takes oneDNN then, numpy's BLAS else (whose M = 1 product is a GEMV, summed in another
        order than its GEMM's)."""
        if dt not in self._brgemm:
            ok = self.supports(dt)
            if ok:
                w = self.pack(np.zeros((64, 64), dt.numpy), dt, scaled=False)
                ok = self.kernel(1, w).startswith("brg:")
                self.lib.dnnl_memory_desc_destroy(w.md)
            self._brgemm[dt] = ok
        return self._brgemm[dt]

    def _exact_s8(self) -> bool:
        """Whether s8 x s8 products come out exact. Without VNNI (plain AVX2) oneDNN pairs
        products in 16-bit saturating adds (vpmaddubsw): 127 x 127 + 127 x 127 saturates, and
        on random data 2.5% of outputs were 2% off; slower than float32 there too."""
        k = 64
        w = np.full((16, k), 127, np.int8)
        x = np.full((1, k), 127, np.int8)
        out = np.zeros((1, 16), np.float32)
        try:
            self.matmul(x, self.pack(w, DataType.S8, scaled=True), out, np.ones(16, np.float32))
        except RuntimeError:
            return False
        return bool((out == k * 127 * 127).all())

    def fingerprint(self) -> str:
        """What decides the packed layout: oneDNN's version and the CPU ISA it runs (a packed
        weights cache is valid only under the same)."""
        v = self.lib.dnnl_version().contents
        isa = self.lib.dnnl_get_effective_cpu_isa()
        return f"oneDNN {v.major}.{v.minor}.{v.patch} {v.hash.decode()} isa {isa:#x}"

    def _primitive(self, m: int, w: Packed) -> tuple:
        lib = self.lib
        pd, prim = self._matmul_pd(m, w.n, w.k, w.dt, w.scaled, w.md), _p()
        self._ok(lib.dnnl_primitive_create(ctypes.byref(prim), pd))
        scaled = w.scaled
        src = self._md((m, w.k), w.dt, (w.k, 1))
        dst = self._md((m, w.n), DataType.F32, (w.n, 1))
        wts = w.md
        n = w.n
        mds = [src, wts, dst] + ([self._md((n,), DataType.F32, (1,))] if scaled else [])
        ids = (_ARG_SRC, _ARG_WEIGHTS, _ARG_DST, _ARG_SCALES | _ARG_WEIGHTS)[: len(mds)]
        return self._bound(prim, mds, ids)

    def _bound(self, prim: _p, mds: list, ids: tuple[int, ...]) -> tuple:
        """(prim, its memory objects, one per descriptor in `mds`, and the execute arguments
        that pass them as `ids`): what `_execute` keeps; buffers are set per call."""
        mems = []
        for md in mds:
            mem = _p()
            self._ok(self.lib.dnnl_memory_create(ctypes.byref(mem), md, self.engine, None))
            mems.append(mem)
        args = (_ExecArg * len(mems))(*[_ExecArg(a, mm) for a, mm in zip(ids, mems, strict=True)])
        return prim, mems, args

    def _clear(self) -> None:
        for prim, mems, _ in self._prims.values():
            self.lib.dnnl_primitive_destroy(prim)
            for mem in mems:
                self.lib.dnnl_memory_destroy(mem)
        self._prims.clear()

    def _fit_threads(self) -> None:
        want = self.threads.n or 0
        if want > 0 and want != self._local.threads and self._omp_set is not None:
            self._omp_set(want)  # this thread's team size (OpenMP keeps it per thread)
            self._local.threads = want

    def kernel(self, m: int, w: Packed) -> str:
        """The implementation oneDNN picks for a matmul of `m` rows by `w` ("brg:avx512_core_amx",
        ...)."""
        pd = self._matmul_pd(m, w.n, w.k, w.dt, w.scaled, w.md)
        name = ctypes.c_char_p()
        status = self.lib.dnnl_primitive_desc_query(pd, _QUERY_IMPL_INFO, 0, ctypes.byref(name))
        self.lib.dnnl_primitive_desc_destroy(pd)
        self._ok(status)
        return (name.value or b"").decode()

    def rows_for(self, m: int, w: Packed) -> int:
        """The rows a matmul of `m` rows by `w` runs with: `m`, or the fewest rows past it whose
        kernel is the one CANONICAL_ROWS rows get (see there). int8 products are integer sums,
        exact whatever the kernel: always `m`. Decided once per (M, shape)."""
        key = (m, w.n, w.k, int(w.dt), w.scaled)
        rows = self._rows.get(key)
        if rows is None:
            rows = m
            if w.dt is not DataType.S8 and m < CANONICAL_ROWS:
                want = self.kernel(CANONICAL_ROWS, w)
                while rows < CANONICAL_ROWS and self.kernel(rows, w) != want:
                    rows += 1
            self._rows[key] = rows
        return rows

    def matmul(self, x: np.ndarray, w: Packed, out: np.ndarray,
               scales: np.ndarray | None = None) -> None:  # fmt: skip
        """out[M, N] = x[M, K] . w[N, K]^T (* scales[N], when `w` was packed scaled); x of the
        weights' type (bf16 as uint16), out float32, both C-contiguous. Row i of out depends
        on row i of x alone, bit for bit, whatever M (`rows_for`)."""
        m = x.shape[0]
        rows = self.rows_for(m, w)
        if rows != m:  # zero rows below: the canonical kernel (~+20% on the head at M = 1)
            padded = np.zeros((rows, w.k), x.dtype)
            padded[:m] = x
            full = np.empty((rows, w.n), np.float32)
            self.matmul(padded, w, full, scales)
            out[...] = full[:m]
            return
        key = (m, w.n, w.k, int(w.dt), w.scaled)  # one layout per shape: buffers set per call
        arrays = (x, w.buffer, out) if scales is None else (x, w.buffer, out, scales)
        self._execute(key, lambda: self._primitive(m, w), arrays)

    def _execute(self, key: tuple, make: Callable[[], tuple], arrays: tuple) -> None:
        """Runs the primitive kept under `key` (made by `make` on first use) over these
        buffers, in the order of its memory objects."""
        with self._lock:
            self._fit_threads()
            entry = self._prims.get(key)
            if entry is None:
                if len(self._prims) >= MAX_PRIMITIVES:
                    self._clear()
                entry = self._prims[key] = make()
            prim, mems, args = entry
            for mem, arr in zip(mems, arrays, strict=True):
                self.lib.dnnl_memory_set_data_handle(mem, arr.ctypes.data)
            self._ok(self.lib.dnnl_primitive_execute(prim, self.stream, len(mems), args))
            self._ok(self.lib.dnnl_stream_wait(self.stream))

    def to_bf16(self, x: np.ndarray) -> np.ndarray:
        """x[M, K] float32 (any row stride) rounded to bfloat16 as MLX's astype rounds (nearest,
        ties to even), as uint16 bits [M, K]: a oneDNN reorder, one pass where the same in
        numpy is five (a 1,776 x 1,536 prompt MLP input: 0.09 ms against 1.7)."""
        m, k = x.shape
        out = np.empty((m, k), np.uint16)
        if out.size == 0:  # oneDNN takes no empty memory
            return out
        strides = _elements(x)
        self._execute(("bf16", m, k, strides), lambda: self._reorder_primitive(
            self._md((m, k), DataType.F32, strides), self._md((m, k), DataType.BF16, (k, 1))),
            (x, out))  # fmt: skip
        return out

    def to_s8(self, x: np.ndarray, inverse_scales: np.ndarray) -> np.ndarray:
        """x[M, K] float32 (any row stride) times inverse_scales[M] (one per row), rounded to
        nearest (ties to even) and saturated to int8 [M, K]: one pass of a oneDNN reorder,
        bit-equal to numpy's multiply, rint and astype (three passes and a temporary)."""
        m, k = x.shape
        out = np.empty((m, k), np.int8)
        if out.size == 0:
            return out
        strides = _elements(x)
        scales = np.ascontiguousarray(inverse_scales, dtype=np.float32)
        self._execute(("s8", m, k, strides), lambda: self._reorder_primitive(
            self._md((m, k), DataType.F32, strides), self._md((m, k), DataType.S8, (k, 1)),
            row_scales=m), (x, out, scales))  # fmt: skip
        return out

    def _reorder_primitive(self, src: _p, dst: _p, row_scales: int = 0) -> tuple:
        """row_scales M: the source is multiplied by a scale per row (per dimension 0: mask
        1), given as a third buffer of M floats."""
        lib = self.lib
        rpd, prim, attr = _p(), _p(), _p()
        self._ok(lib.dnnl_primitive_attr_create(ctypes.byref(attr)))
        if row_scales:
            self._ok(lib.dnnl_primitive_attr_set_scales_mask(attr, _ARG_SRC, 1))
        self._ok(lib.dnnl_reorder_primitive_desc_create(
            ctypes.byref(rpd), src, self.engine, dst, self.engine, attr))  # fmt: skip
        self._ok(lib.dnnl_primitive_create(ctypes.byref(prim), rpd))
        mds, ids = [src, dst], (_ARG_SRC, _ARG_DST)
        if row_scales:
            mds.append(self._md((row_scales,), DataType.F32, (1,)))
            ids += (_ARG_SCALES | _ARG_SRC,)
        bound = self._bound(prim, mds, ids)
        lib.dnnl_primitive_desc_destroy(rpd)  # the primitive and the memories keep their copies
        lib.dnnl_primitive_attr_destroy(attr)
        for md in mds:
            lib.dnnl_memory_desc_destroy(md)
        return bound

    def bmm(self, a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
        """out[B, M, N] = a[B, M, K] @ b[B, K, N], all float32, each of any element strides, as
        one primitive over the whole batch, threaded by oneDNN, where numpy's matmul makes B
        separate small BLAS calls. Decode attention uses it for probabilities x values (192
        products of 3 rows a layer at width 64); over a transposed view (keys read as [B, D, L])
        it was twice as slow as numpy's calls on a Zen 4, so those scores stay numpy's. A shared
        prefix's two products are real GEMMs (3 of 192 x 912 x 64 at width 64): there its two
        threads beat numpy's one (0.41 against 0.83 ms, and 0.35 against 0.75)."""
        strides = (_elements(a), _elements(b), _elements(out))
        self._execute(
            ("bmm", a.shape, b.shape, strides),
            lambda: self._bmm_primitive(a.shape, b.shape, strides),
            (a, b, out),
        )

    def _bmm_primitive(self, a_shape: tuple[int, ...], b_shape: tuple[int, ...],
                       strides: tuple[tuple[int, ...], ...]) -> tuple:  # fmt: skip
        lib = self.lib
        (batch, m, k), n = a_shape, b_shape[2]
        src = self._md((batch, m, k), DataType.F32, strides[0])
        wts = self._md((batch, k, n), DataType.F32, strides[1])
        dst = self._md((batch, m, n), DataType.F32, strides[2])
        attr, pd, prim = _p(), _p(), _p()
        self._ok(lib.dnnl_primitive_attr_create(ctypes.byref(attr)))
        self._ok(lib.dnnl_matmul_primitive_desc_create(
            ctypes.byref(pd), self.engine, src, wts, None, dst, attr))  # fmt: skip
        self._ok(lib.dnnl_primitive_create(ctypes.byref(prim), pd))
        bound = self._bound(prim, [src, wts, dst], (_ARG_SRC, _ARG_WEIGHTS, _ARG_DST))
        lib.dnnl_primitive_desc_destroy(pd)  # the primitive and the memories keep their copies
        lib.dnnl_primitive_attr_destroy(attr)
        for md in (src, wts, dst):
            lib.dnnl_memory_desc_destroy(md)
        return bound


def _elements(a: np.ndarray) -> tuple[int, ...]:
    """a's strides in elements (oneDNN's descriptors count elements, numpy bytes)."""
    return tuple(s // a.itemsize for s in a.strides)


def _omp_setter():
    """libgomp's omp_set_num_threads (already loaded by libdnnl), or None."""
    try:
        fn = ctypes.CDLL("libgomp.so.1").omp_set_num_threads
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    return fn


def library_candidates(explicit: str | None = None) -> list[str]:
    """Paths of libdnnl to try, best first: `explicit` (BATCHMLX_ONEDNN_LIB), then <prefix>/lib
    of this Python (where the onednn wheels put it)."""
    found = [explicit] if explicit else []
    for prefix in python_prefixes():
        for name in _LIB_NAMES:
            found += sorted(glob.glob(str(prefix / "lib" / name)))
    return list(dict.fromkeys(found))


def open_library(explicit: str | None = None, threads: ComputeThreads | None = None) -> OneDNN:
    """oneDNN, loaded (the HostBackend keeps it: backend.py); OneDNNUnavailable (with what to
    install) when it cannot be. `threads`: the engine's count its OpenMP team follows."""
    import mlx.core as mx

    if mx.default_device().type != mx.DeviceType.cpu:
        raise OneDNNUnavailable("the host weight formats run on MLX's CPU backend only; on a "
                                "GPU use --dtype auto (quantized MLX kernels)")  # fmt: skip
    set_openmp_defaults()  # threads.OPENMP_DEFAULTS: libgomp reads them when it starts
    errors = []
    for path in library_candidates(explicit):
        try:
            return OneDNN(path, threads)
        except (OSError, AttributeError, RuntimeError) as exc:
            errors.append(f"{path}: {exc}")
    detail = f" (tried: {'; '.join(errors)})" if errors else ""
    raise OneDNNUnavailable(INSTALL_HINT + detail)


def quantize_rows(x: np.ndarray, lib: OneDNN | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row: x ~= q * s, s = max|x_row| / 127 (1 for an all-zero row).
    A row holding NaN or infinity keeps it in its scale (so the product shows it, as a float
    GEMM's would) and quantizes to zeros: casting NaN to int8 is undefined (numpy warns).
    lib: oneDNN rounds in one reorder, bit-equal to the numpy passes below (a 1,024 x 1,536
    GEMM input: 0.63 ms against 1.53 in all, 2026-12-02)."""
    amax = np.maximum(x.max(axis=1), -x.min(axis=1))
    s = amax * np.float32(1.0 / 127.0)
    s[s == 0] = 1.0
    if lib is not None:
        return lib.to_s8(x, np.float32(1.0) / s), s
    with np.errstate(invalid="ignore"):  # infinity x 0 in a row whose scale is infinite
        t = np.multiply(x, (np.float32(1.0) / s)[:, None])
    np.rint(t, out=t)
    if not np.isfinite(s).all():  # max() propagates NaN, so a finite scale means finite t
        t[~np.isfinite(s)] = 0.0
    return t.astype(np.int8), s
