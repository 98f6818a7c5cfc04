"""Decode attention straight from the paged KV pool: native/attn.c, a kernel of our own.

Each decode row (one query token of one sequence) reads its keys and values block by block
through its block table, with a block-wise online softmax in a fixed order (attn.c's header):
no gather, no dense copy of the decodes' KV (kv/decode.py), no oneDNN product, and a row's bits
depend on its own keys alone, never on the batch, its width or the split over threads. Rows
behind a prefix every one of them shares walk its blocks block-major (each read once for all
while in cache) with the same per-(row, block) arithmetic: the cascade gives the bits of the
row alone. A prompt's queries (DecodeRows.tiles) go through AMX-BF16 tiles where they run
(native/attn_amx.h): a chunk's queries, and a step's chunks behind one system prompt, share
their keys, which a tile product scores for 16 query vectors at once.

The library ships prebuilt (native/libbatchmlx_attn.so; `python -m
batchmlx.engine.host.native_lib --build attn` remakes it). Where it cannot run (another CPU or
OS) the host step keeps numpy's decode attention over the dense copy.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cache

import numpy as np

from batchmlx.engine.host.native_lib import (
    FLOAT,
    INT,
    NativeLibrary,
    P,
    Signature,
    cpu_has,
    pointer,
    register,
)

CPU_FLAGS = ("avx512f",)
LIB = register(NativeLibrary("attn", CPU_FLAGS, ("-mavx512f",), "paged decode-attention kernel", (
    Signature("attn_decode", (P, P, P, INT, P, INT, P, *[INT] * 9, FLOAT, P), INT),
    Signature("attn_decode_pooled", (P, P, P, INT, P, INT, P, *[INT] * 8, FLOAT, P, P, INT, INT),
              INT),
    Signature("attn_decode_step", (P, P, P, INT, P, P, P, INT, P, INT, P, *[INT] * 8, FLOAT, P, P,
                                   INT, INT), INT),
    Signature("attn_amx_init", (), INT),
    Signature("attn_set_amx", (INT,), INT),
    Signature("attn_scatter", (P, INT, INT, P, P, INT)),
    Signature("attn_gather", (P, INT, P, INT, INT, P)),
)))  # fmt: skip
# rows x query heads x keys from which a call's rows are split over two threads (a hand-off
# costs ~30-50 us; one such call is ~40 us of work)
SPLIT_WORK = 1 << 15
# a pooled call's (row, KV head) units go out in about this many claims a thread: rows' keys
# differ, and a thread that finishes early takes another
CLAIMS_PER_THREAD = 4
# the shapes the kernel takes (attn.c's MAX_D, MAX_REP)
MAX_D = 512
MAX_REP = 16
# what the pool may hold: float16 is widened exactly on load (F16C, part of AVX-512F's vcvtph2ps)
POOL_DTYPES = (np.dtype(np.float32), np.dtype(np.float16))


# what the tile path needs besides (and q8's AMX check: a CPU may advertise AMX and trap it)
AMX_FLAGS = ("amx_tile", "amx_bf16", "avx512_bf16")


def library() -> ctypes.CDLL | None:
    """The kernel, or None where it cannot run here (see native_lib); the reason is logged once.
    Its tile path (attn_amx.h) is on from the first call where `amx()` holds."""
    lib = LIB.load()
    if lib is not None:
        amx()
    return lib


@cache
def amx() -> bool:
    """Whether this process's kernel computes through AMX-BF16 tiles (native/attn_amx.h) for
    every shape it takes there (D a multiple of 32): the CPU has them, q8's AMX path runs
    here (its self-test in a child, and Linux's leave for the tile state). Decided once: the
    two paths' sums differ in their last bits, so a process runs one."""
    from batchmlx.engine.host import q8

    lib = LIB.load()
    return (lib is not None and cpu_has(AMX_FLAGS) and q8.amx()
            and lib.attn_amx_init() == 0)  # fmt: skip


def set_amx(on: bool) -> bool:
    """Turns the tile path off, or on again where `amx()` holds (tests: both paths' bits on one
    machine). Returns whether it is on."""
    lib = library()
    return lib is not None and bool(lib.attn_set_amx(int(on and amx())))


def takes(head_dim: int, rep: int) -> bool:
    """Whether the kernel runs here for this attention shape."""
    return head_dim % 16 == 0 and head_dim <= MAX_D and rep <= MAX_REP and library() is not None


@dataclass(frozen=True, slots=True)
class DecodeRows:
    """A step's decode rows as the kernel reads them: tables [R, blocks] int32 block ids of
    each row's sequence (its shared prefix's first), counts [R] int32 keys each row sees,
    shared: blocks every row's table starts with (the same ones: a cascade's prefix). tiles:
    the rows are prompt queries, through AMX tiles where they run (`amx`; attn_amx.h): a
    prompt's tokens always attend this way and generated ones never, so a token's bits
    still depend on its own keys alone."""

    tables: np.ndarray
    counts: np.ndarray
    shared: int = 0
    tiles: bool = False
    # (rep_heads, threads) -> `splits`: a step's rows are split once, not once a layer
    _splits: dict[tuple[int, int], list[tuple[int, int]]] = field(
        default_factory=dict, compare=False, repr=False)  # fmt: skip

    @classmethod
    def of(cls, tables: np.ndarray, counts: np.ndarray, shared: int = 0,
           tiles: bool = False) -> DecodeRows:  # fmt: skip
        return cls(np.ascontiguousarray(tables, dtype=np.int32),
                   np.ascontiguousarray(counts, dtype=np.int32), shared, tiles)  # fmt: skip

    def split(self, rep_heads: int, threads: int) -> list[tuple[int, int]]:
        """`splits`, found once per shape."""
        key = (rep_heads, threads)
        if key not in self._splits:
            self._splits[key] = self.splits(rep_heads, threads)
        return self._splits[key]

    def splits(self, rep_heads: int, threads: int) -> list[tuple[int, int]]:
        """Row ranges, one per thread, of about equal keys (one range below SPLIT_WORK)."""
        n = len(self.counts)
        work = np.cumsum(self.counts, dtype=np.int64)
        if threads <= 1 or n < 2 or int(work[-1]) * rep_heads < SPLIT_WORK:
            return [(0, n)]
        cuts = [0]
        for t in range(1, threads):
            cut = int(np.searchsorted(work, work[-1] * t / threads))
            cuts.append(min(max(cut, cuts[-1] + 1), n - 1))
        return [(a, b) for a, b in zip(cuts, [*cuts[1:], n], strict=True) if a < b]


def decode(
    q: np.ndarray,
    kpool: np.ndarray,
    vpool: np.ndarray,
    rows: DecodeRows,
    kv_heads: int,
    block_size: int,
    *,
    window: int | None = None,
    softcap: float | None = None,
    pool: ThreadPoolExecutor | None = None,
    threads: int = 1,
    ranges: list[tuple[int, int]] | None = None,
    runner: int | None = None,
) -> np.ndarray:
    """q [R, H * rep, D] float32 (scaled) against the pool's keys and values (float32 or
    float16, C-contiguous, row ((block * H + head) * block_size + offset) of D; H = kv_heads) -> [R,
    H * rep, D]. window: each row sees its last `window` keys only; softcap: scores ->
    softcap * tanh(s / softcap). With `runner` (q8.pool_runner: the GEMMs' workers) the rows'
    (row, KV head) parts go to its `threads` in one C call; else the rows are split over this
    thread and `pool`'s (`threads` in all) unless `ranges` names the split. A row's result is
    the same bits whichever."""
    lib = library()
    if lib is None:
        raise RuntimeError("paged decode-attention kernel unavailable (see the log)")
    r, hq, d = q.shape
    h = kv_heads
    if not (kpool.flags.c_contiguous and vpool.flags.c_contiguous):
        raise ValueError("the pool must be C-contiguous")
    if kpool.dtype != vpool.dtype or kpool.dtype not in POOL_DTYPES:
        raise ValueError(f"the kernel reads a float32 or float16 pool, not {kpool.dtype}")
    if q.dtype != np.float32 or not q.flags.c_contiguous:
        q = np.ascontiguousarray(q, dtype=np.float32)
    out = np.empty((r, hq, d), np.float32)
    tables = rows.tables
    half = int(kpool.dtype == np.float16)
    args = (pointer(q), pointer(kpool), pointer(vpool), half, pointer(tables),
            tables.shape[1], pointer(rows.counts))  # fmt: skip
    tail = (h, hq // h, d, block_size, rows.shared, int(rows.tiles), window or 0,
            float(softcap or 0.0), pointer(out))  # fmt: skip
    if runner is not None and ranges is None and threads > 1:
        code = lib.attn_decode_pooled(
            *args, r, *tail[:-1], pointer(out), runner, threads, _claim(r * h, threads),
        )  # fmt: skip
        _taken(code, d, hq // h)
        return out
    parts = ranges or rows.split(hq, threads if pool is not None else 1)
    jobs = [pool.submit(lib.attn_decode, *args, a, b, *tail) for a, b in parts[1:]] if pool else []
    codes = [lib.attn_decode(*args, *parts[0], *tail)] if parts else []
    codes += [job.result() for job in jobs]
    _taken(int(any(codes)), d, hq // h)
    return out


def _claim(units: int, threads: int) -> int:
    """(row, KV head) units a pooled call's thread takes at a time (CLAIMS_PER_THREAD)."""
    return max(1, units // (threads * CLAIMS_PER_THREAD))


def _taken(code: int, d: int, rep: int) -> None:
    """The kernel's answer: 0, or it did not take the shape."""
    if code:
        raise ValueError(f"attn_decode does not take D={d}, rep={rep}")


@dataclass(frozen=True, slots=True)
class DecodeStep:
    """A step of kernel rows alone (decodes, or one prompt chunk's queries: step_kv), each layer
    one call (attn_decode_step: the new keys and values scattered, then the rows' attention on
    `runner`'s workers, as `decode`): a one-row step's layer was ~65 us of Python around ~20
    us of kernel as five calls. What does not change between layers is converted once a
    step."""

    write: WriteRows
    rows: DecodeRows
    kv_heads: int
    block_size: int
    runner: int  # q8.pool_runner()
    threads: int

    def layer(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, kpool: np.ndarray,
              vpool: np.ndarray, window: int | None,
              softcap: float | None) -> np.ndarray:  # fmt: skip
        """q [R, Hq, D] (scaled), k, v [R, H, D] float32 -> [R, Hq, D]; kpool, vpool: as
        `decode` reads them (the caller checked they are)."""
        lib = library()
        assert lib is not None
        r, hq, d = q.shape
        h = self.kv_heads
        k = np.ascontiguousarray(k, dtype=np.float32)
        v = np.ascontiguousarray(v, dtype=np.float32)
        q = np.ascontiguousarray(q, dtype=np.float32)
        out = np.empty((r, hq, d), np.float32)
        rows, write = self.rows, self.write.rows
        code = lib.attn_decode_step(
            pointer(k), pointer(v), pointer(write), write.shape[0], pointer(q), pointer(kpool),
            pointer(vpool), int(kpool.dtype == np.float16), pointer(rows.tables),
            rows.tables.shape[1], pointer(rows.counts), r, h, hq // h, d, self.block_size,
            rows.shared, int(rows.tiles), window or 0, float(softcap or 0.0), pointer(out),
            self.runner, self.threads, _claim(r * h, self.threads),
        )  # fmt: skip
        _taken(code, d, hq // h)
        return out


@dataclass(frozen=True, slots=True)
class WriteRows:
    """A step's pool rows for `scatter` (int32), checked once against the pool's length (every
    layer's pool has the same): a one-row decode step scatters 60 times, and the conversion
    and the bounds check were half of each call."""

    rows: np.ndarray
    pool_rows: int

    @classmethod
    def of(cls, rows: np.ndarray, pool_rows: int) -> WriteRows:
        rows = np.ascontiguousarray(rows, dtype=np.int32)
        if rows.size and (int(rows.max()) >= pool_rows or int(rows.min()) < 0):
            raise IndexError("a row outside the pool")
        return cls(rows, pool_rows)


def scatter(pool: np.ndarray, rows: np.ndarray | WriteRows, src: np.ndarray) -> None:
    """pool[rows] = src (float32 rows of D) into a float32 or float16 pool [N, D], rounded to
    float16 to nearest even (F16C) where it is one: numpy's and MLX's rounding, without
    numpy's scalar conversion loop."""
    lib = library()
    plain = rows.rows if isinstance(rows, WriteRows) else rows
    if lib is None or pool.dtype not in POOL_DTYPES or not pool.flags.c_contiguous:
        pool[plain] = src
        return
    src = np.ascontiguousarray(src, dtype=np.float32)
    checked = (rows if isinstance(rows, WriteRows) and rows.pool_rows == pool.shape[0]
               else WriteRows.of(plain, pool.shape[0]))  # fmt: skip
    lib.attn_scatter(pointer(src), checked.rows.shape[0], pool.shape[1], pointer(checked.rows),
                     pointer(pool), int(pool.dtype == np.float16))  # fmt: skip


def gather(runs_of: np.ndarray, runs: np.ndarray) -> np.ndarray:
    """runs_of[runs] as float32 (runs_of: the pool as [N, run] float32 or float16; runs: any
    shape of int indices): a float16 pool's rows widened as they are copied."""
    lib = library()
    if runs_of.dtype == np.float32 or lib is None or not runs_of.flags.c_contiguous:
        out = runs_of[runs]
        return out if out.dtype == np.float32 else out.astype(np.float32)
    flat = np.ascontiguousarray(runs, dtype=np.int32).reshape(-1)
    if flat.size and (int(flat.max()) >= runs_of.shape[0] or int(flat.min()) < 0):
        raise IndexError("a run outside the pool")
    out = np.empty((flat.shape[0], runs_of.shape[1]), np.float32)
    lib.attn_gather(pointer(runs_of), 1, pointer(flat), flat.shape[0], runs_of.shape[1],
                    pointer(out))  # fmt: skip
    return out.reshape(*runs.shape, runs_of.shape[1])
