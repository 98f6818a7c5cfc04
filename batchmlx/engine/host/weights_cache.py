"""Host-format weights kept on disk between starts: oneDNN's packed bytes, read back instead of
converted and packed again.

Converting a model to a host format (engine/host/linear.py) reads every float weight, rounds
or quantizes it and reorders it into oneDNN's blocked layout: 1.2 s of the default model's
start, 25 s at SmolLM2-1.7B's shape and 169 s at 8B (benchmarks/RESULTS.md). The first start
writes what the model ended with into one safetensors file under the model cache
(`<cache>/host/<folder>-<digest>.<format>.safetensors`); later starts read each layer's bytes
as it is built and never touch its float weights. The file is valid for one source and one
library: its metadata holds a signature of the source folder's weight files (names, sizes,
modification times), the format, oneDNN's version and the CPU ISA it runs (which decide the
packed layout); anything else makes the start pack again and rewrite the file. A file that
cannot be written (a full disk, a read-only cache) only costs the next start the packing.
`BATCHMLX_HOST_CACHE=0` turns it off (HostSettings.weights_cache; the loader asks it).

The packed bytes are used where they lie: the file is memory-mapped read-only and oneDNN reads
each layer's weights from the mapping (the page cache), as llama.cpp maps its GGUF. Copying
them into fresh memory cost more than anything else in a start, page faults on new anonymous
memory running at ~0.5 GB/s on the VMs measured (a 1.8 GB int8 1.7B file: 2.96 s to read into
MLX arrays, 0.02 s to map and touch every page; 2026-12-02). The file is still safetensors (MLX
and the `safetensors` package read it), written by `_write` with every tensor 64-byte aligned:
padding entries (`__pad__.N`) fill the gaps, as the format allows no holes. A first start
packs the grouped int8 layers straight into the file it is writing (`PackArena`: their bytes
are its shared mapping's pages from the start), so only the small parts and the header are
written after, and the model computes from the same pages a warm start maps.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import mmap
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from batchmlx.engine.host import head8, q4, q8
from batchmlx.engine.host.linear import HostFormat, PackedCache
from batchmlx.engine.host.onednn import OneDNN
from batchmlx.engine.models import first_run as notes

# bump when the keys, parts or file layout change: older files are then rewritten
# (2: tensors 64-byte aligned, memory-mapped)
HOST_CACHE_VERSION = 2
_SIGNATURE_KEY = "batchmlx_host_signature"
log = logging.getLogger("batchmlx.engine")


def cache_path(cache_dir: Path, source: Path, fmt: HostFormat) -> Path:
    digest = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:10]
    return Path(cache_dir) / "host" / f"{source.name}-{digest}.{fmt.value}.safetensors"


def signature(source: Path, fmt: HostFormat, lib: OneDNN) -> str:
    """What the cached bytes were made from and for, by `lib` (see the module docstring)."""
    parts = [f"v{HOST_CACHE_VERSION}", fmt.value, lib.fingerprint()]
    if fmt in (HostFormat.INT8, HostFormat.Q4) and q8.available():  # packed by our own code
        parts.append(f"q8-{q8.GROUP}-{q8.source_sha()}")
    if fmt is HostFormat.Q4 and q4.available():
        parts.append(f"q4-{q4.GROUP}-{q4.source_sha()}")
    if fmt is HostFormat.INT8 and head8.available():  # its W8 head's layout
        parts.append(f"head8-{head8.GROUP}-{head8.source_sha()}")
    for f in sorted(source.glob("*.safetensors")) + [source / "config.json"]:
        if f.is_file():
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def open_cache(path: Path, sig: str) -> PackedCache:
    """The cache of `path` when its signature is `sig`; else an empty one (pack everything).
    Each layer's packed bytes and an embedding's rows (its lookup table) are read-only numpy
    views of the mapped file: resident as far as they are read (a run's lookups touch the
    pages of the tokens it sees, not the whole table), never copied into anonymous memory. The
    small parts (scales, bias) are copied into MLX arrays."""
    if not path.is_file():
        return PackedCache()
    try:
        views, meta = _map(path)
    except (OSError, ValueError) as exc:
        log.warning("host weights cache %s unreadable (%s): packing again", path, exc)
        return PackedCache()
    if meta.get(_SIGNATURE_KEY) != sig:
        log.info("host weights cache %s is for another model, format or library: packing again",
                 path.name)  # fmt: skip
        return PackedCache()
    found: dict[str, np.ndarray | mx.array] = {}
    for key, (view, dtype) in views.items():
        if key.endswith((".packed", ".plain")):  # (an embedding's bf16 rows: their bits)
            found[key] = view
        else:
            a = mx.array(view)
            found[key] = a.view(mx.bfloat16) if dtype == "BF16" else a
    return PackedCache(found=found)


# safetensors dtype names <-> the numpy type their bytes are read as (bf16 as its uint16 bits)
_NUMPY = {"U8": np.uint8, "I8": np.int8, "U16": np.uint16, "BF16": np.uint16, "F16": np.float16,
          "F32": np.float32, "I32": np.int32, "I64": np.int64}  # fmt: skip
_NAMES = {mx.uint8: "U8", mx.int8: "I8", mx.uint16: "U16", mx.bfloat16: "BF16",
          mx.float16: "F16", mx.float32: "F32", mx.int32: "I32", mx.int64: "I64"}  # fmt: skip
_ALIGN = 64  # every tensor's first byte, in the file and so in the mapping (page-aligned)
_PAD = "__pad__."
_MAX_HEADER = 64 << 20


def _map(path: Path) -> tuple[dict[str, tuple[np.ndarray, str]], dict[str, str]]:
    """({name: (read-only view of its bytes in the mapped file, dtype name)}, metadata); every
    entry checked against the file's size (a cut file raises ValueError, never maps short)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = int.from_bytes(f.read(8), "little")
        if size < 8 or not 0 < n <= min(_MAX_HEADER, size - 8):
            raise ValueError("not a safetensors file")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"bad header: {exc}") from None
        if not isinstance(header, dict):
            raise ValueError("bad header")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict):
            raise ValueError("bad metadata")
        start, room = 8 + n, size - 8 - n
        spans = {}
        for key, entry in header.items():
            try:
                dtype, shape, (lo, hi) = entry["dtype"], entry["shape"], entry["data_offsets"]
                if not all(isinstance(x, int) and x >= 0 for x in (*shape, lo, hi)):
                    raise ValueError("shape and offsets must be whole numbers")
                want = int(np.prod(shape, dtype=np.int64)) * np.dtype(_NUMPY[dtype]).itemsize
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"bad entry {key!r}: {exc}") from None
            if not 0 <= lo <= hi <= room or hi - lo != want:
                raise ValueError(f"entry {key!r} runs past the end of the file (cut short?)")
            if not key.startswith(_PAD):
                spans[key] = (dtype, tuple(shape), lo, hi)
        if not spans:
            return {}, meta
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)  # kept alive by its views
    data = np.frombuffer(mapped, np.uint8)
    views = {key: (data[start + lo : start + hi].view(_NUMPY[dt]).reshape(shape), dt)
             for key, (dt, shape, lo, hi) in spans.items()}  # fmt: skip
    return views, meta


def _host_arrays(arrays: dict[str, mx.array | np.ndarray]) -> dict[str, tuple[np.ndarray, str]]:
    """Each array as numpy with its safetensors dtype name (MLX's evaluated here, in the
    caller's thread: the writer thread never calls MLX); numpy arrays (packed bytes read from
    a mapped file) are uint8."""
    host: dict[str, tuple[np.ndarray, str]] = {}
    for key, a in arrays.items():
        if isinstance(a, mx.array):
            name = _NAMES[a.dtype]
            host[key] = (np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a), name)
        else:
            host[key] = (np.asarray(a), next(k for k, v in _NUMPY.items() if v == a.dtype))
    return host


_SYNC_BYTES = 256 << 20  # written, then synced, this much at a time
# the header's room at the start of a PackArena's file: ~100 bytes an entry; a 1.7B model's
# has ~300 entries, a 128-expert MoE's tens of thousands (a larger header: the file anew)
_HEADER_ROOM = 1 << 20
_FREE_MARGIN = 1 << 30  # a window is refused where less than this would be left free
_datasync = getattr(os, "fdatasync", os.fsync)  # (macOS has no fdatasync)


def _write(path: Path, host: dict[str, tuple[np.ndarray, str]], metadata: dict[str, str]) -> None:
    """A safetensors file of `host` (_host_arrays) with each tensor's bytes 64-byte aligned
    (see the module docstring)."""
    entries: dict[str, object] = {"__metadata__": metadata}
    order: list[np.ndarray | int] = []  # arrays, and pad byte counts
    at = 0
    for key, (a, name) in host.items():
        if at % _ALIGN:
            pad = _ALIGN - at % _ALIGN
            entries[f"{_PAD}{len(order)}"] = {"dtype": "U8", "shape": [pad],
                                               "data_offsets": [at, at + pad]}  # fmt: skip
            order.append(pad)
            at += pad
        entries[key] = {"dtype": name, "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        order.append(a)
        at += a.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)  # (trailing spaces are allowed in the header)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        unsynced = 0
        for item in order:
            if isinstance(item, int):
                f.write(bytes(item))  # padding
                continue
            data = memoryview(np.ascontiguousarray(item)).cast("B")
            for at in range(0, len(data), _SYNC_BYTES):
                f.write(data[at : at + _SYNC_BYTES])
                unsynced += min(_SYNC_BYTES, len(data) - at)
                if unsynced >= _SYNC_BYTES:
                    # to disk as it goes: Linux starts writing dirty pages back only past ~10%
                    # of memory, so one fsync at the end found all 2.1 GB of a 1.7B model's
                    # file still to write, after its first job had finished
                    f.flush()
                    _datasync(f.fileno())
                    unsynced = 0
        f.flush()
        os.fsync(f.fileno())


class PackArena:
    """A cache file written as the model is packed: each layer's packed bytes are a window of
    the file's shared mapping (`room`), so the kernel packs them straight into the page cache
    and the model computes from them there, as a warm start does from the finished file.
    Written after the packing and copied into the file, a 1.7B model's 2.1 GB took ~4.5 s of
    CPU in the kernel's copy (perf: 36% of a first start's samples), beside the first batch.
    `_finish_arena` then writes the other parts and the header (into room kept for it at the
    start), syncs and renames; a header that does not fit falls back to writing the whole
    file anew. Blocks are allocated as each window is given (posix_fallocate): a full disk
    refuses a window (the layer packs into fresh memory), never faults a write into it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(f".{os.getpid()}.{next(_names)}.{path.name}")
        self.start = _HEADER_ROOM  # the data's first byte in the file: page-aligned
        self.end = 0  # data bytes given out
        self.spans: dict[int, tuple[int, int]] = {}  # a window's address -> (offset, bytes)
        self.failed = False
        path.parent.mkdir(parents=True, exist_ok=True)
        _sweep(path)
        self.fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)

    @staticmethod
    def usable() -> bool:
        return hasattr(os, "posix_fallocate") and hasattr(mmap, "MAP_SHARED")

    def room(self, nbytes: int) -> np.ndarray | None:
        """nbytes in the file (page-aligned: a mapping's offset must be), or None."""
        if self.failed or nbytes <= 0:
            return None
        if self.spans and hasattr(os, "posix_fadvise"):
            # the window before is packed: its pages to disk now, in the background (Linux
            # starts writeback at DONTNEED and keeps mapped pages), not all 2.1 GB (1.7B) at
            # the final fsync, whose writeback stalled the KV pool's allocation after the load
            # (1.5 s against 0.07 warm)
            last, size = next(reversed(self.spans.values()))
            try:
                os.posix_fadvise(self.fd, self.start + last, size, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass  # (only sooner on disk: the final fsync writes it anyway)
        at = -(-self.end // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
        try:
            if shutil.disk_usage(self.tmp.parent).free < nbytes + _FREE_MARGIN:
                raise OSError("the disk is nearly full")
            os.posix_fallocate(self.fd, self.start + at, nbytes)
            window = mmap.mmap(self.fd, nbytes, offset=self.start + at)
        except OSError as exc:
            log.info("host weights cache: packing into fresh memory (%s)", exc)
            self.failed = True
            return None
        a = np.frombuffer(window, np.uint8)
        self.spans[a.ctypes.data] = (at, nbytes)
        self.end = at + nbytes
        return a

    def close(self) -> None:
        """Give up the file (its windows stay valid while the model holds them)."""
        if self.fd >= 0:
            fd, self.fd = self.fd, -1  # (never closed twice: the number may be reused)
            try:
                os.close(fd)
            except OSError:
                pass
        self.tmp.unlink(missing_ok=True)


# the files being written behind the start (save_cache(background=True)): the interpreter
# joins these non-daemon threads before it exits, so a process that finishes its work first
# still leaves a whole file (or none: each is written to a temporary name, then renamed)
_writers: list[threading.Thread] = []
_names = itertools.count()


def save_cache(
    path: Path,
    cache: PackedCache,
    sig: str,
    fmt: HostFormat | None = None,
    *,
    background: bool = False,
    then: Callable[[], None] | None = None,
    arena: PackArena | None = None,
) -> bool:
    """Write what the model ended with when a layer was packed anew (atomically: a temporary
    file renamed). False when there was nothing to write or it could not be written (or, in
    the background, could not be started). `background`: the bytes go to disk in a thread
    while the engine starts: on the VMs measured a 1.7B model's 2.3 GB took 7-11 s to write
    and sync (~270 MB/s), a third of a first start that was ~2.4x a warm one. `then`: called
    once the file is in place (in the writer's thread when in the background). `arena`: the
    file the layers were packed into (PackArena), finished rather than written anew."""
    if arena is not None and (arena.failed or not arena.spans):
        arena.close()  # (nothing in it, or not all: the file is written as usual)
        arena = None
    if cache.packed == 0 or not cache.kept:
        if arena is not None:
            arena.close()
        return False
    size = sum(a.nbytes for a in cache.kept.values())
    # (one name per call: a second load of the model may write while the first still does)
    tmp = path.with_name(f".{os.getpid()}.{next(_names)}.{path.name}")
    _sweep(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(path.parent).free
        if free < (size if arena is None else 0) + size // 8:
            log.info("host weights cache not written: %d MB needed, %d MB free in %s",
                     size >> 20, free >> 20, path.parent)  # fmt: skip
            if arena is not None:
                arena.close()
            return False
        notes.note("saving the %sweights packed for the host GEMMs (%s), so that later starts read "
                   "them instead of packing again: %s", f"{fmt.value} " if fmt else "",
                   notes.size_text(size), path)  # fmt: skip
        host = _host_arrays(cache.kept)
    except (OSError, RuntimeError, ValueError) as exc:
        log.warning("host weights cache %s not written: %s", path, exc)
        if arena is not None:
            arena.close()
        return False
    args = (tmp, path, host, sig, then, arena)
    if not background:
        return _finish(*args)
    # daemon=False said outright: a thread takes its starter's flag, and models load on the
    # engine's thread, a daemon (one left to inherit it was killed at exit: only temporary
    # files stayed, and every start packed again)
    writer = threading.Thread(target=_finish, args=args, name="batchmlx-weights-cache",
                              daemon=False)  # fmt: skip
    _writers.append(writer)
    writer.start()
    return True


def _sweep(path: Path) -> None:
    """Remove the temporary files of `path` that processes no longer alive left (killed while
    they wrote: each up to the whole file's size)."""
    for stale in path.parent.glob(f".*.{path.name}"):
        pid = stale.name.split(".")[1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            stale.unlink(missing_ok=True)
        except OSError:  # alive under another user: not ours to judge
            continue


def _finish(tmp: Path, path: Path, host: dict[str, tuple[np.ndarray, str]], sig: str,
            then: Callable[[], None] | None = None,
            arena: PackArena | None = None) -> bool:  # fmt: skip
    try:
        if arena is None or not _finish_arena(arena, host, {_SIGNATURE_KEY: sig}):
            if arena is not None:
                arena.close()
            _write(tmp, host, {_SIGNATURE_KEY: sig})
            os.replace(tmp, path)
    except (OSError, RuntimeError, ValueError) as exc:
        log.warning("host weights cache %s not written: %s", path, exc)
        tmp.unlink(missing_ok=True)
        if arena is not None:
            arena.close()
        return False
    notes.wrote()
    if then is not None:
        then()
    return True


def _finish_arena(
    arena: PackArena, host: dict[str, tuple[np.ndarray, str]], metadata: dict[str, str]
) -> bool:
    """The parts not packed into `arena` written after its windows, the header into its room
    (gaps padded: safetensors allows no holes), synced, renamed; False when the header does
    not fit its room (nothing renamed)."""
    placed: list[tuple[int, str, str, np.ndarray]] = []
    at, used = arena.end, set()
    for key, (a, name) in host.items():
        span = arena.spans.get(a.ctypes.data) if a.nbytes else None
        if span is not None and span[1] == a.nbytes and span[0] not in used:
            placed.append((span[0], key, name, a))
            used.add(span[0])
            continue
        at = -(-at // _ALIGN) * _ALIGN
        data = memoryview(np.ascontiguousarray(a)).cast("B")
        done = 0
        while done < len(data):  # (pwrite may write less than asked)
            done += os.pwrite(arena.fd, data[done : done + _SYNC_BYTES], arena.start + at + done)
        placed.append((at, key, name, a))
        at += a.nbytes
    entries: dict[str, object] = {"__metadata__": metadata}
    end = 0
    for off, key, name, a in sorted(placed, key=lambda p: p[0]):
        if off > end:
            entries[f"{_PAD}{len(entries)}"] = {"dtype": "U8", "shape": [off - end],
                                                "data_offsets": [end, off]}  # fmt: skip
        entries[key] = {"dtype": name, "shape": list(a.shape),
                        "data_offsets": [off, off + a.nbytes]}  # fmt: skip
        end = off + a.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    if len(text) > arena.start - 8:
        return False
    text += b" " * (arena.start - 8 - len(text))  # (trailing spaces are allowed in the header)
    os.ftruncate(arena.fd, arena.start + end)
    os.pwrite(arena.fd, len(text).to_bytes(8, "little") + text, 0)
    os.fsync(arena.fd)  # the windows' pages too: the whole file, then its name
    fd, arena.fd = arena.fd, -1
    os.close(fd)
    os.replace(arena.tmp, arena.path)
    return True


def wait_written(timeout: float | None = None) -> bool:
    """Wait for the files save_cache is writing in the background; False if one still runs
    after `timeout` seconds."""
    for writer in list(_writers):
        writer.join(timeout)
        if writer.is_alive():
            return False
        _writers.remove(writer)
    return True
