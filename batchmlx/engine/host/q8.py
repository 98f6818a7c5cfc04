"""The `int8` host format's GEMM: weights and activations int8 in groups of GROUP along K, each
group with its own float32 scale, in a kernel of our own (native/q8.c: AVX-512 VNNI, and AMX
where it runs).

Why a kernel of our own: oneDNN 3.2 (the CPU build on PyPI) scales an int8 GEMM per output
channel and per tensor only. Per-channel weights with per-token activations lost too much
(teacher-forced top-1 0.877 against float32 on alice29.txt, KLD 0.034; llama.cpp's Q8_0 0.956 /
0.0039), while groups along K are what Q8_0 and OpenVINO GenAI's CPU default do
(benchmarks/RESULTS-int8.md: G=64 0.952 / 0.0058; G=32 0.954 / 0.0039; here, with a bf16 head,
G=32 measured 0.9625 / 0.0032: benchmarks/RESULTS-fidelity.md). And grouped int8 is
batch-invariant by construction: integer sums are exact and the float epilogue is the same per
element whatever the batch (q8.c's header), and whether VNNI or AMX computes it: both sum the
same integers and run the same float epilogue, so a request's answer does not depend on the
CPU having AMX. AMX (from AMX_ROWS rows, where `amx()` finds it usable) runs one group per tile
product and its epilogue beside the next group's products; one 135M layer's four GEMMs on one
thread of a 2-core Sapphire Rapids Xeon (benchmarks/RESULTS-int8.md, kernel section) took 0.20
/ 0.21 / 0.47 / 0.88 / 3.3 ms at 1 / 8 / 32 / 64 / 256 rows against oneDNN bf16's (on AMX too)
0.81 / 0.50 / 0.75 / 1.34 / 4.2; VNNI alone 0.20 / 0.30 / 0.86 / 1.57 / 6.3, ahead of oneDNN's
bf16 without AMX (avx512_core_bf16: 0.37 at 1 row, 18.0 at 256).

A GEMM is one C call (q8_matmul): activations quantized (native/grouped.h, shared with q4.c),
then columns split from SPLIT_MACS multiply-adds over this thread and the library's pthread
pool (native/pool.h, shared with q4.c: each library has a pool of its own).

The library ships prebuilt (native/libbatchmlx_q8.so, ~150 KB, for x86-64 Linux, glibc 2.17+)
so that a user needs no compiler (engine/host/native_lib.py: `python -m
batchmlx.engine.host.native_lib --build q8` remakes it; a library older than its .c or a header
it includes is refused, and a test fails).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import platform
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, cached_property
from pathlib import Path

import numpy as np

from batchmlx.engine.host.experts import RunsGemm, RunsGemms
from batchmlx.engine.host.native_lib import (
    I64,
    INT,
    WIDEN,
    NativeLibrary,
    P,
    Signature,
    cpu_has,
    fresh_bytes,
    pointer,
    register,
    widened,
)

log = logging.getLogger("batchmlx.engine")

# K per scale: Q8_0's. G=64 cost ~15-25% less here, but scored 0.9516 / 0.0058 (top-1 agreement
# / KLD against float32, RESULTS-int8.md) where G=32 with a float head scores 0.9604 / 0.0031,
# past llama.cpp's Q8_0 (0.9561 / 0.0039)
GROUP = 32
TILE = 16  # output columns per vector: N must be a multiple
# what the library is compiled for; the CPU must have each (/proc/cpuinfo's names)
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
# its pool's threads (glibc < 2.34 keeps them in libpthread)
TARGET_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-pthread")
_GEMM = (INT, INT, INT, INT, P, P, P, P, P, P, INT, INT)
LIB = register(NativeLibrary("q8", CPU_FLAGS, TARGET_FLAGS, "grouped int8 kernel", (
    Signature("q8_quantize", (INT, INT, INT, P, I64, P, P, INT)),
    Signature("q8_gemm", _GEMM),
    Signature("q8_gemm_amx", _GEMM),
    Signature("q8_amx_init", (), INT),
    Signature("q8_matmul", (INT, INT, INT, INT, P, I64, *[P] * 6, INT, INT, INT)),
    Signature("q8_pack", (INT, INT, INT, P, INT, I64, P, P, P, INT)),
    Signature("q8_experts", (INT, P, INT, P, *[INT] * 4, P, I64, *[P] * 4, INT, INT, INT), INT),
    Signature("q8_pool_run", (P, P, INT, INT, INT)),
    Signature("q8_pool_workers", (), INT),
    Signature("q8_pool_helped", (), I64),
)))  # fmt: skip
SOURCE = LIB.source
LIBRARY = LIB.path
# what its AMX path needs besides (and Linux's leave, and a CPU that does not trap it: `amx`)
AMX_FLAGS = ("amx_tile", "amx_int8")
# from this many rows a GEMM goes through AMX where it runs (same bits as VNNI; faster from here)
AMX_ROWS = 4
# a GEMM of at least this many multiply-adds is split over threads by columns (q8.c's pool:
# ~4 us to wake a sleeping worker, ~1 us to hand a spinning one its part; through a Python
# thread pool the hand-off was 30-50 us and this was 4 << 20, so no one-row decode GEMM split).
# 1 << 18: one row of every 135M GEMM, its o (576 x 576, ~25 us on one thread) too: at 1 << 19
# the o ran alone, and a width-1 decode step's int8 GEMMs took 8.01 against 7.62 ms (settings
# alternated step by step in one engine, 2-core Xeon, 2026-12-07; width 8 level)
SPLIT_MACS = 1 << 18
# column chunks per thread when split: one, so each thread streams one run of columns (a late
# thread's is still taken by the other from the shared counter). A chunk's first columns come
# slowly (its weights start a new stream; a 64-column chunk of a 576 x 576 GEMM at 64 rows took
# 13-18 us on two threads, against 8 us per 64 columns on one), so 4 a thread gave two little:
# width-64 decode steps of the default model, chunks alternated step by step in one process,
# int8 GEMMs 30.2 -> 26.2 ms (step 73.3 -> 67.6) with 4 -> 1, 10% at width 32, 7% at 128, a
# mixture's experts ~10% at 32-64 tokens; level beside a busy process (2-core Xeon, 2026-12-07)
CHUNKS = 1


def source_sha() -> str:
    return LIB.source_sha()


def library() -> ctypes.CDLL | None:
    """The kernel, or None where it cannot run here (see native_lib); the reason is logged once."""
    return LIB.load()


def available() -> bool:
    return library() is not None


# run in a child: a CPU that advertises AMX but traps it (some do) ends that process, not ours
_AMX_PROBE = "import ctypes, sys; sys.exit(ctypes.CDLL(sys.argv[1]).q8_amx_selftest())"


@cache
def amx() -> bool:
    """Whether the AMX path runs here: the CPU says it has AMX, Linux grants its tile state,
    and q8.c's self-test (AMX against VNNI, bit for bit) passes in a child process. The
    child's verdict is kept in the cache folder (`_amx_mark`), so it runs once per machine
    and library, not at every start (~30 ms)."""
    lib = library()
    if lib is None or not cpu_has(AMX_FLAGS):
        return False
    mark = _amx_mark()
    verdict = mark.read_text() if mark is not None and mark.is_file() else ""
    if verdict not in ("yes", "no"):
        try:
            done = subprocess.run([sys.executable, "-I", "-c", _AMX_PROBE, str(LIBRARY)],
                                  capture_output=True, timeout=30)  # fmt: skip
            verdict = "yes" if done.returncode == 0 else "no"
        except (OSError, subprocess.SubprocessError):
            return False  # asked again at the next start
        if mark is not None:
            try:
                mark.parent.mkdir(parents=True, exist_ok=True)
                mark.write_text(verdict)
            except OSError:
                pass
    if verdict == "no":
        log.info("grouped int8 kernel: AMX advertised but failed its self-test; VNNI only")
        return False
    return lib.q8_amx_init() == 0


def _amx_mark() -> Path | None:
    """The file holding the AMX self-test's verdict ("yes" / "no"), named by what it depends
    on: the library, this CPU's flags, the kernel release (Linux < 5.16 grants no
    tile state)."""
    from batchmlx.config import load_settings  # no MLX, no SQL
    from batchmlx.engine.host.fast_blas import cpu_flags

    try:
        st = LIBRARY.stat()
    except OSError:
        return None
    parts = [source_sha(), str(st.st_size), str(st.st_mtime_ns), platform.release()]
    key = "\0".join([*parts, " ".join(sorted(cpu_flags()))])
    name = hashlib.sha1(key.encode()).hexdigest()[:16]
    return Path(load_settings().cache_dir) / "q8-probes" / name


def fits(n: int, k: int) -> bool:
    """Whether the kernel takes a GEMM of this shape (N, K multiples of 16)."""
    return n % TILE == 0 and k % TILE == 0


@dataclass(frozen=True)
class Q8Weights:
    """One GEMM's weights [N, K] in one byte buffer: the int8 values in the kernel's layout
    ([N/16][K/4][16][4]), then the scales float32, then -128 x each group's sum int32, both
    [N/16][ng][16] (VNNI feeds activations as unsigned bytes, x + 128, and starts its integer
    sums there to take that back out)."""

    buffer: np.ndarray  # uint8, C-contiguous
    n: int
    k: int

    @staticmethod
    def nbytes(n: int, k: int) -> int:
        return n * k + 8 * groups(k) * n

    @cached_property
    def packed(self) -> np.ndarray:
        return self.buffer[: self.n * self.k].view(np.int8)

    @cached_property
    def scales(self) -> np.ndarray:
        at = self.n * self.k
        return self.buffer[at : at + 4 * groups(self.k) * self.n].view(np.float32)

    @cached_property
    def offsets(self) -> np.ndarray:
        at = self.n * self.k + 4 * groups(self.k) * self.n
        return self.buffer[at:].view(np.int32)

    @cached_property
    def addresses(self) -> tuple[int, int, int]:
        """The three parts' addresses, as the kernel takes them: found once, not at every GEMM
        (three slices and their ctypes objects a call were ~1.4% of an int8 engine's steps)."""
        return self.packed.ctypes.data, self.scales.ctypes.data, self.offsets.ctypes.data

    @classmethod
    def pack(cls, w: np.ndarray | Sequence[np.ndarray], *, threads: int = 1,
             into: np.ndarray | None = None) -> Q8Weights:  # fmt: skip
        """w[N, K] quantized: per (row, group of GROUP), s = max|w| / 127 (1 for an all-zero
        group), q = round(w / s) in [-127, 127]. w float32, float16, or bf16 as its bits
        (uint16), or several such tables one after another along N (a layer's q, k and v),
        each read as it lies: in q8.c's `q8_pack` where it runs (one pass, split over
        `threads`), else in numpy (float32 first); the same bits either way. `into`: the
        nbytes(N, K) bytes to write (else fresh pages: native_lib.fresh_bytes)."""
        parts = [w] if isinstance(w, np.ndarray) else list(w)
        n, k = sum(p.shape[0] for p in parts), parts[0].shape[1]
        buf = fresh_bytes(cls.nbytes(n, k)) if into is None else into
        out = cls(buf.reshape(-1).view(np.uint8), n, k)
        lib = library()
        if lib is not None and all(_packs_here(p) for p in parts):
            # each part's rows are whole tiles: its bytes lie in one span of each of the three
            wp, ws, wc = out.addresses
            ng, row = groups(k), 0
            for p in parts:
                lib.q8_pack(p.shape[0], k, GROUP, p.ctypes.data, WIDEN[p.dtype],
                            p.strides[0] // p.itemsize, wp + row * k, ws + 4 * row * ng,
                            wc + 4 * row * ng, max(1, threads))  # fmt: skip
                row += p.shape[0]
            return out
        w = parts[0] if len(parts) == 1 else np.concatenate([widened(p) for p in parts])
        q, s = quantize_groups_numpy(widened(w))
        ng = groups(k)
        # [N/16][K/4][16][4]: moved as 4-byte words, one pass (bytes took ~7x as long)
        words = np.ascontiguousarray(q).view(np.int32).reshape(n // TILE, TILE, k // 4)
        out.packed.view(np.int32).reshape(n // TILE, k // 4, TILE)[:] = words.transpose(0, 2, 1)
        out.scales[:] = _by_tile(s)
        if k % GROUP:
            q = np.pad(q, ((0, 0), (0, ng * GROUP - k)))
        out.offsets[:] = _by_tile(-128 * q.reshape(n, ng, GROUP).sum(axis=2, dtype=np.int32))
        return out

    @classmethod
    def adopt(cls, buffer: np.ndarray, n: int, k: int) -> Q8Weights | None:
        """Bytes `pack` made earlier (a weights cache), or None when their size does not fit."""
        buffer = np.asarray(buffer).reshape(-1).view(np.uint8)
        return cls(buffer, n, k) if buffer.nbytes == cls.nbytes(n, k) else None


def _by_tile(a: np.ndarray) -> np.ndarray:
    """[N, ng] -> [N/16][ng][16], flat: each tile of 16 columns' groups in a row."""
    n, ng = a.shape
    return a.reshape(n // TILE, TILE, ng).transpose(0, 2, 1).ravel()


def _packs_here(w: np.ndarray) -> bool:
    """Whether q8_pack takes this table as it lies (a type it reads, whole tiles of rows)."""
    return w.dtype in WIDEN and fits(*w.shape) and w.strides[1] == w.itemsize


def groups(k: int) -> int:
    return -(-k // GROUP)


def quantize_groups(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x[R, K] float32 -> int8 [R, K] and scales [R, ng]: per row and group of GROUP (the last
    group may be shorter), s = max|x| / 127 (1 for an all-zero group), q = round(x / s). A
    group holding NaN or infinity gets s = NaN and zeros, as the kernel's activations do (a
    float GEMM would show it too; casting NaN to int8 is undefined). In q8.c's `q8_quantize`
    where it runs (the same bits: tests/engine/test_q8.py), else in numpy: packing a 1.7B
    model's weights took ~40 s of numpy passes at a first start, ~1.5 s in C."""
    lib = library()
    r, k = x.shape
    if lib is None or k % 16 or x.dtype != np.float32 or r == 0:
        return quantize_groups_numpy(x)
    x = np.ascontiguousarray(x)
    ng = groups(k)
    q = np.empty((r, k), np.uint8)
    s = np.empty((r, ng), np.float32)
    lib.q8_quantize(r, k, GROUP, x.ctypes.data, k, q.ctypes.data, s.ctypes.data, 0)
    np.bitwise_xor(q, np.uint8(0x80), out=q)  # its unsigned form (q + 128) back to signed
    return q.view(np.int8), s


def quantize_groups_numpy(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_groups in numpy: the reference, and where the kernel does not run."""
    r, k = x.shape
    ng = groups(k)
    padded = np.zeros((r, ng * GROUP), np.float32)
    padded[:, :k] = x
    g = padded.reshape(r, ng, GROUP)
    with np.errstate(invalid="ignore"):
        amax = np.abs(g).max(axis=2)
    finite = np.isfinite(amax)
    usable = finite & (amax > 0)
    safe = np.where(usable, amax, np.float32(1))
    s = np.where(finite, safe / np.float32(127), np.float32(np.nan)).astype(np.float32)
    s[finite & ~usable] = 1
    inv = np.where(usable, np.float32(127) / safe, np.float32(0)).astype(np.float32)
    g = np.where(finite[:, :, None], g, np.float32(0))
    q = np.clip(np.rint(g * inv[:, :, None]), -127, 127).astype(np.int8)
    return q.reshape(r, ng * GROUP)[:, :k].copy(), s


Scratch = tuple[tuple[int, ...], tuple[np.ndarray, ...]]  # addresses, buffers


class _Scratch(threading.local):
    """A thread's quantized activations and their scales (and, for q4, their sums), kept
    between GEMMs with their addresses: two buffers and their addresses a call were ~4 us of
    the ~20 us of Python around each GEMM of a decode step (120 a step at 135M). Only this
    thread's call uses them, from quantizing to the GEMM's end (its pool threads read them
    while it waits)."""

    def __init__(self) -> None:
        # (K, sums) -> (rows it has room for, (its addresses, the buffers))
        self.by_k: dict[tuple[int, bool], tuple[int, Scratch]] = {}


_SCRATCH = _Scratch()
# larger activations (a prompt's) get buffers of their own call, not kept
SCRATCH_BYTES = 1 << 20


def scratch(rows: int, k: int, sums: bool = False) -> Scratch:
    """Room for `rows` quantized rows of K and their group scales (and sums: q4's): the
    addresses (xq, xs[, xsum]), and the buffers (the caller holds them until its GEMM ends)."""
    held = _SCRATCH.by_k.get((k, sums))
    if held is not None and held[0] >= rows:
        return held[1]
    parts = 2 if sums else 1
    bufs = (np.empty((rows, k), np.uint8), np.empty((parts, rows, groups(k)), np.float32))
    addresses = (bufs[0].ctypes.data, *(bufs[1][i].ctypes.data for i in range(parts)))
    if rows * k <= SCRATCH_BYTES:
        _SCRATCH.by_k[(k, sums)] = (rows, (addresses, bufs))
    return addresses, bufs


def matmul(x: np.ndarray, w: Q8Weights, out: np.ndarray, *, threads: int = 1,
           use_amx: bool | None = None) -> None:  # fmt: skip
    """out[M, N] = x[M, K] . w^T, x float32 rows (any row stride, unit column stride), out
    float32 C-contiguous. Split by columns over `threads` (this thread and q8.c's pool) when it
    is large enough, through AMX from AMX_ROWS rows where it runs (`use_amx` forces either
    way): a row's result is the same however it is split and whichever path computes it."""
    lib = library()
    if lib is None:
        raise RuntimeError("grouped int8 kernel unavailable (see the log)")
    m, k = x.shape
    if use_amx is None:
        use_amx = m >= AMX_ROWS and k % GROUP == 0 and amx()
    elif use_amx and not (k % GROUP == 0 and amx()):
        raise RuntimeError("the grouped int8 kernel's AMX path does not run here")
    if x.dtype != np.float32 or x.strides[1] != 4:
        x = np.ascontiguousarray(x, dtype=np.float32)
    # AMX reads its activations and their scales as tiles of 16 rows: the last one rounded up
    (xq, xs), _held = scratch(-(-m // 16) * 16 if use_amx else m, k)
    if m * w.n * k < SPLIT_MACS:
        threads = 1
    lib.q8_matmul(m, w.n, k, GROUP, pointer(x), x.strides[0] // 4, xq, xs, *w.addresses,
                  pointer(out), int(use_amx), max(1, threads),
                  column_chunk(w.n, threads, use_amx))  # fmt: skip


def column_chunk(n: int, threads: int, use_amx: bool) -> int:
    """Columns a thread claims at a time from the pool's shared counter (q8.c's q8_matmul, and
    q4.c's): N over CHUNKS a thread, whole tiles (AMX takes columns 32 at a time); a thread
    that starts late finds them taken."""
    step = 2 * TILE if use_amx else TILE
    return max(step, n // (CHUNKS * max(1, threads)) // step * step)


@dataclass(frozen=True)
class Q8Experts:
    """A mixture's experts' GEMMs of one shape [N, K] (each a Q8Weights), for `matmul_experts`:
    their addresses in one table [E][3], found once."""

    weights: tuple[Q8Weights, ...]  # held: the table points into their buffers

    def __post_init__(self) -> None:
        if len({(w.n, w.k) for w in self.weights}) != 1:
            raise ValueError("experts' GEMMs of different shapes")

    @property
    def n(self) -> int:
        return self.weights[0].n

    @property
    def k(self) -> int:
        return self.weights[0].k

    @cached_property
    def table(self) -> np.ndarray:
        return np.array([w.addresses for w in self.weights], np.uint64)


MAX_EXPERTS = 1024  # experts a call takes at most (q8.c's q8_experts)


def matmul_experts(x: np.ndarray, experts: np.ndarray, bounds: np.ndarray, w: Q8Experts,
                   out: np.ndarray, *, threads: int = 1) -> None:  # fmt: skip
    """out[bounds[a]:bounds[a + 1]] = x[bounds[a]:bounds[a + 1]] . W_e^T for e = experts[a]:
    each expert's GEMM on its own run of rows in one call (q8.c's q8_experts), its columns split
    over `threads` with the others'. A row's result is `matmul`'s of that row alone (each
    expert's rows go through AMX from AMX_ROWS rows where it runs, as `matmul`'s would; both
    paths give the same bits). experts int32 [A], bounds int32 [A + 1] ascending from 0; x
    float32 rows [M, K] (any row stride, unit column stride), out float32 [M, N] C-contiguous;
    each expert index below E."""
    lib = library()
    if lib is None:
        raise RuntimeError("grouped int8 kernel unavailable (see the log)")
    count = len(experts)
    if count == 0:
        return
    m, k = x.shape
    if (count > MAX_EXPERTS or len(bounds) != count + 1 or k != w.k or out.shape != (m, w.n)
            or out.dtype != np.float32 or not out.flags.c_contiguous):  # fmt: skip
        raise ValueError(f"{count} experts, {len(bounds)} bounds, x {x.shape}, out {out.shape}")
    use_amx = k % GROUP == 0 and amx()
    if x.dtype != np.float32 or x.strides[1] != 4:
        x = np.ascontiguousarray(x, dtype=np.float32)
    # each expert's quantized rows from a 16-row boundary (AMX's tiles)
    (xq, xs), _held = scratch(m + 16 * count, k)
    experts = np.ascontiguousarray(experts, np.int32)
    bounds = np.ascontiguousarray(bounds, np.int32)
    n = w.n
    if m * n * k < SPLIT_MACS:
        threads = 1
    failed = lib.q8_experts(count, pointer(experts), len(w.weights), pointer(bounds), m, n, k,
                            GROUP, pointer(x), x.strides[0] // 4, xq, xs, pointer(w.table),
                            pointer(out), AMX_ROWS if use_amx else 0, max(1, threads),
                            column_chunk(n, threads, use_amx))  # fmt: skip
    if failed:
        raise ValueError(f"experts {experts.tolist()} of {len(w.weights)}, bounds "
                         f"{bounds.tolist()} for {m} rows")  # fmt: skip


def expert_runs(gate_up: Sequence[Q8Weights | None], down: Sequence[Q8Weights | None],
                threads: Callable[[], int]) -> RunsGemms | None:  # fmt: skip
    """A mixture's experts' GEMMs (engine/host/experts.py) a group of runs at a time, over
    `threads()` threads (the live count, asked at each call); None unless every one is in this
    kernel's format (the others go one expert at a time)."""
    ups, downs = [w for w in gate_up if w is not None], [w for w in down if w is not None]
    if not ups or len(ups) != len(gate_up) or len(downs) != len(down):
        return None

    def gemm(table: Q8Experts) -> RunsGemm:
        def run(rows: np.ndarray, ids: np.ndarray, bounds: np.ndarray, out: np.ndarray) -> None:
            matmul_experts(rows, ids, bounds, table, out, threads=threads())

        return run

    return RunsGemms(gemm(Q8Experts(tuple(ups))), gemm(Q8Experts(tuple(downs))))


def pool_workers() -> tuple[int, int]:
    """Threads q8.c's pool has started (at the first split GEMM), and the columns they have
    computed since."""
    lib = library()
    return (0, 0) if lib is None else (lib.q8_pool_workers(), lib.q8_pool_helped())


@functools.cache  # asked once a layer: the library is loaded once a process
def pool_runner() -> int | None:
    """The address of q8.c's `q8_pool_run` (its GEMM workers, lent to other kernels: the
    paged decode attention's units, the elementwise passes' rows; native/runner.h), or None
    where the library does not run here."""
    lib = library()
    return None if lib is None else ctypes.cast(lib.q8_pool_run, ctypes.c_void_p).value
