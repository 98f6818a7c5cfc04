"""Freed memory the process keeps for reuse, bounded.

MLX's CPU buffers come from the C allocator (glibc's malloc on Linux). Two pools keep freed
buffers: MLX's own buffer cache, bounded by its limit (kv/budget.size_buffer_cache), and
glibc's heap, bounded by nothing. glibc mmaps an allocation above its mmap threshold and gives
it back at free, but the threshold is dynamic: each free of an mmapped chunk raises it to that
chunk's size (up to 32 MiB), after which buffers of that size live in the heap, and a heap only
shrinks from its top. Under `serve`'s mixed load (KV pool growth, prefill chunks, embeddings
passes) the heap held 150-700 MB of freed memory that RSS never lost; which high-water mark a
run's samples caught decided the load test's "memory flat" (+13.8% in one run, -14.3% in
another). Measured in benchmarks/RESULTS-load.md.

The bound: the heap's free pages go back to the OS every HEAP_TRIM_S of engine work
(`HeapTrimmer`, malloc_trim: a few ms, then the pages reused fault back in once), and at once
when a large one-off piece of work ends or the engine goes idle (`release_free_memory`, which
also empties MLX's cache). What stays between two trims is at most what the steps of those
seconds freed. A fixed mmap threshold (`bound_host_heap`, every buffer above 1 MiB mmapped and
unmapped) bounds it tighter, but measured +12% CPU per decode step (2.7x the page faults: the
heap was the reuse MLX's cache, then 256 MiB, misses), so it is there for whoever wants it, not on.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import mlx.core as mx

log = logging.getLogger(__name__)

HEAP_TRIM_S = 5.0  # engine work between two trims of the heap's free pages
MMAP_THRESHOLD = 1 << 20  # buffers above this are mmapped: freed, they leave the process
# MLX's buffer cache while a model's layers are converted (`buffers_reused`)
LOAD_BUFFER_CACHE = 512 << 20
_M_TRIM_THRESHOLD = -1  # mallopt's parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3


@cache
def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):  # musl and others have neither: nothing to bound here
        return None
    return libc


def bound_host_heap(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` (which ends its dynamic raising) and trim the
    heap's top past twice that. Process-wide; False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold))
    ok &= bool(libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold))
    if not ok:
        log.warning("could not fix the C allocator's mmap threshold")
    return ok


def release_free_memory() -> int:
    """Give freed memory back to the OS: MLX's buffer cache emptied, the heap's free pages
    trimmed. Returns the bytes MLX's cache held."""
    cached = mx.get_cache_memory()
    mx.clear_cache()
    trim_heap()
    return cached


def trim_heap() -> bool:
    """The heap's free pages back to the OS (glibc's malloc_trim; False elsewhere)."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


class HeapTrimmer:
    """Calls `trim_heap` at most every `every_s` seconds, from the engine's steps."""

    def __init__(self, every_s: float = HEAP_TRIM_S, clock=time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self.trims = 0
        self._next = clock() + every_s

    def tick(self) -> None:
        now = self.clock()
        if now >= self._next:
            self._next = now + self.every_s
            trim_heap()
            self.trims += 1


@contextmanager
def buffers_reused(limit: int = LOAD_BUFFER_CACHE) -> Iterator[None]:
    """MLX's buffer cache raised to `limit` (never lowered) while a model's layers are read
    and converted one at a time, so that each layer's reads reuse the buffers the one before
    freed (the same shapes); then its limit back and the cache emptied. At MLX's CPU default
    (32 MiB) every read of a 1.7B bf16 folder took fresh pages: 641K page faults and ~1.5 s
    of a first start's 2.3 s of reads, against 59K and 0.8 s (this 2-core VM)."""
    previous = mx.set_cache_limit(limit)
    if previous > limit:
        mx.set_cache_limit(previous)
    try:
        yield
    finally:
        mx.set_cache_limit(previous)
        mx.clear_cache()
