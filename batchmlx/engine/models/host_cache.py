"""Host-format weights kept on disk between starts: oneDNN's packed bytes, read back instead of
converted and packed again.

Converting a model to a host format (kernels/host_linear.py) reads every float weight, rounds
or quantizes it and reorders it into oneDNN's blocked layout: 1.2 s of the default model's
start, 25 s at SmolLM2-1.7B's shape and 169 s at 8B (benchmarks/RESULTS.md). The first start
writes what the model ended with into one safetensors file under the model cache
(`<cache>/host/<folder>-<digest>.<format>.safetensors`); later starts read each layer's bytes
as it is built and never touch its float weights. The file is valid for one source and one
library: its metadata holds a signature of the source folder's weight files (names, sizes,
modification times), the format, oneDNN's version and the CPU ISA it runs (which decide the
packed layout); anything else makes the start pack again and rewrite the file. A file that
cannot be written (a full disk, a read-only cache) only costs the next start the packing.
`BATCHMLX_HOST_CACHE=0` turns it off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

import mlx.core as mx

from batchmlx.engine.kernels.host_linear import HostFormat, PackedCache
from batchmlx.engine.kernels.onednn import load_library
from batchmlx.engine.models import notes

SWITCH = "BATCHMLX_HOST_CACHE"
HOST_CACHE_VERSION = 1  # bump when the keys or parts change: older files are then rewritten
_SIGNATURE_KEY = "batchmlx_host_signature"
log = logging.getLogger("batchmlx.engine")


def enabled() -> bool:
    return os.environ.get(SWITCH, "1").strip() != "0"


def cache_path(cache_dir: Path, source: Path, fmt: HostFormat) -> Path:
    digest = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:10]
    return Path(cache_dir) / "host" / f"{source.name}-{digest}.{fmt.value}.safetensors"


def signature(source: Path, fmt: HostFormat) -> str:
    """What the cached bytes were made from and for (see the module docstring)."""
    parts = [f"v{HOST_CACHE_VERSION}", fmt.value, load_library().fingerprint()]
    for f in sorted(source.glob("*.safetensors")) + [source / "config.json"]:
        if f.is_file():
            st = f.stat()
            parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def open_cache(path: Path, sig: str) -> PackedCache:
    """The cache of `path` when its signature is `sig`; else an empty one (pack everything)."""
    if not path.is_file():
        return PackedCache()
    try:
        arrays, meta = mx.load(str(path), return_metadata=True)
    except (OSError, RuntimeError, ValueError) as exc:
        log.warning("host weights cache %s unreadable (%s): packing again", path, exc)
        return PackedCache()
    if meta.get(_SIGNATURE_KEY) != sig:
        log.info("host weights cache %s is for another model, format or library: packing again",
                 path.name)  # fmt: skip
        return PackedCache()
    return PackedCache(found=arrays)


def save_cache(path: Path, cache: PackedCache, sig: str, fmt: HostFormat | None = None) -> bool:
    """Write what the model ended with when a layer was packed anew (atomically: a temporary
    file renamed). False when there was nothing to write or it could not be written."""
    if cache.packed == 0 or not cache.kept:
        return False
    size = sum(a.nbytes for a in cache.kept.values())
    tmp = path.with_name(f".{os.getpid()}.{path.name}")  # (MLX keeps a .safetensors suffix)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(path.parent).free
        if free < 2 * size:
            log.info("host weights cache not written: %d MB needed, %d MB free in %s",
                     size >> 20, free >> 20, path.parent)  # fmt: skip
            return False
        notes.note("saving the %sweights packed for oneDNN (%s), so that later starts read "
                   "them instead of packing again: %s", f"{fmt.value} " if fmt else "",
                   notes.size_text(size), path)  # fmt: skip
        mx.save_safetensors(str(tmp), cache.kept, metadata={_SIGNATURE_KEY: sig})
        os.replace(tmp, path)
    except (OSError, RuntimeError, ValueError) as exc:
        log.warning("host weights cache %s not written: %s", path, exc)
        tmp.unlink(missing_ok=True)
        return False
    notes.wrote()
    return True
