"""The host backend's own C kernels: each a source in native/ shipped with its library prebuilt.

A kernel `NAME` is native/NAME.c, compiled into native/libbatchmlx_NAME.so for x86-64 Linux
(glibc 2.17+) so that a user needs no compiler. The library answers the SHA-1 of the source it
was built from (`NAME_source_sha()`, set by -DNAME_SOURCE_SHA at build): the .c and the headers
of native/ it includes (`#include "NAME.h"`, and theirs), so a library older than any of them is
refused, and its tests fail. `python -m batchmlx.engine.host.native_lib --build
[NAME ...]` remakes them with zig's C compiler (the `ziglang` wheel), else `cc`.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import platform
import re
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger("batchmlx.engine")

NATIVE = Path(__file__).parent / "native"
# a header of native/ a source includes: `#include "grouped.h"`
INCLUDE = re.compile(rb'^\s*#\s*include\s+"([^"/]+)"', re.MULTILINE)
# floats as written (no fused multiply-add contraction): the same bits from every build
COMMON_FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off")


# the C types the kernels' signatures name
P, INT, I64, FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


@dataclass(frozen=True)
class Signature:
    """One function a library exports: its arguments' C types, and its result's (None: void).
    ctypes would take anything without them (a float as an int, a 64-bit stride cut to 32)."""

    name: str
    args: tuple[Any, ...] = ()
    result: Any = None


@dataclass(frozen=True)
class NativeLibrary:
    """One kernel's source and library, the CPU flags it is compiled for (/proc/cpuinfo's
    names; the CPU must have each), the compiler's target options, and the functions it
    exports (`load` gives each its signature)."""

    name: str
    cpu_flags: tuple[str, ...]
    target_flags: tuple[str, ...]
    what: str  # for the log: "grouped int8 kernel"
    signatures: tuple[Signature, ...] = ()

    @property
    def source(self) -> Path:
        return NATIVE / f"{self.name}.c"

    @property
    def path(self) -> Path:
        return NATIVE / f"libbatchmlx_{self.name}.so"

    def sources(self) -> list[Path]:
        """The .c, then the headers of native/ it includes (theirs too), each once."""
        found = [self.source]
        for path in found:  # grows as it goes: a header's own headers come after it
            for name in INCLUDE.findall(path.read_bytes()):
                header = NATIVE / name.decode()
                if header not in found:
                    found.append(header)
        return found

    def source_sha(self) -> str:
        """SHA-1 of the .c's bytes, then of each header's name and bytes (a source with no
        header of ours: the .c's alone, as before headers were shared)."""
        sha = hashlib.sha1(self.source.read_bytes())
        for header in self.sources()[1:]:
            sha.update(b"\0" + header.name.encode() + b"\0" + header.read_bytes())
        return sha.hexdigest()[:16]

    def load(self) -> ctypes.CDLL | None:
        """The library with its functions' signatures set, or None where it cannot run here
        (another OS or CPU, or a library built from another source than the one beside it);
        the reason is logged once."""
        # by identity first: _load's cache hashes this frozen dataclass (its signatures, field
        # by field, ~3 us), and a one-row decode step asks ~300 times
        held = _LOADED.get(id(self))
        if held is None or held[0] is not self:
            held = _LOADED[id(self)] = (self, _load(self))
        return held[1]

    def build(self, target: Path | None = None) -> Path:
        """Compile the source into `target` (default: the shipped library's path)."""
        target = target or self.path
        try:
            import ziglang  # noqa: F401

            # glibc 2.17's symbols: the library loads on any Linux of the last decade
            cc = [sys.executable, "-m", "ziglang", "cc", "-target", "x86_64-linux-gnu.2.17"]
        except ImportError:
            cc = ["cc"]
        sha = f'-D{self.name.upper()}_SOURCE_SHA="{self.source_sha()}"'
        flags = [*COMMON_FLAGS, *self.target_flags, sha]
        subprocess.run([*cc, *flags, "-o", str(target), str(self.source)], check=True)
        return target


def cpu_has(flags: tuple[str, ...]) -> bool:
    from batchmlx.engine.host.fast_blas import cpu_flags

    have = cpu_flags()
    return all(f in have for f in flags)


_LOADED: dict[int, tuple[Any, Any]] = {}  # id -> (NativeLibrary, what its load gave)


@cache
def _load(lib: NativeLibrary) -> ctypes.CDLL | None:
    why = None
    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")):
        why = "it is built for x86-64 Linux"
    elif not cpu_has(lib.cpu_flags):
        why = f"this CPU lacks one of {', '.join(lib.cpu_flags)}"
    elif not lib.path.is_file():
        why = f"{lib.path} is missing"
    if why is None:
        try:
            handle = ctypes.CDLL(str(lib.path))
        except OSError as exc:
            why = f"{lib.path} does not load ({exc})"
        else:
            answer = getattr(handle, f"{lib.name}_source_sha")
            answer.restype = ctypes.c_char_p
            built = answer().decode()
            try:
                shipped = lib.source_sha()
            except OSError as exc:  # a header it includes missing
                why = f"its source {exc.filename} is missing"
            else:
                if built == shipped:
                    return _signed(handle, lib)
                why = f"{lib.path.name} was built from other sources ({built}): rebuild it"
    log.info("%s unavailable: %s", lib.what, why)
    return None


def _signed(handle: ctypes.CDLL, lib: NativeLibrary) -> ctypes.CDLL:
    for sig in lib.signatures:
        function = getattr(handle, sig.name)  # (its source has it: the SHA matched)
        function.argtypes, function.restype = list(sig.args), sig.result
    return handle


_BYTES = ctypes.c_char * 0


def pointer(a: np.ndarray) -> ctypes.Array | int:
    """What a kernel takes for a's first element: a ctypes view of a contiguous, writable
    array (~0.5 us), else its address (`a.ctypes.data`, ~1.5 us; a decode step passes ~1,000)."""
    try:
        return _BYTES.from_buffer(a)
    except TypeError:  # a strided view, or read-only
        return a.ctypes.data


# the weight tables q8.c and head8.c pack as they lie (native/widen.h's codes): bf16 as its
# bits, float16 and float32
WIDEN = {np.dtype(np.float32): 0, np.dtype(np.uint16): 1, np.dtype(np.float16): 2}


def widened(w: np.ndarray) -> np.ndarray:
    """A table of WIDEN's types as float32 (bf16 bits: the high half of a float's word)."""
    if w.dtype == np.uint16:
        return (w.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return np.asarray(w, np.float32)


def fresh_bytes(n: int) -> np.ndarray:
    """n bytes of new memory (uint8), its zero pages faulted in 4 KiB at a time as they are
    first written: a first start's packed weights. Not np.empty: numpy asks Linux for
    transparent huge pages on large arrays (madvise), and where THP's defrag policy is
    "madvise" (the default) a huge-page fault may compact memory first. Faulting 2.1 GB (a
    1.7B model's int8 weights) took 3.0-5.6 s that way, 1.2-1.75 s in 4 KiB pages (this
    2-core VM, most of its memory page cache)."""
    if n == 0:
        return np.empty(0, np.uint8)
    # private: Python's default for an anonymous map is shared, whose pages are shmem's
    # (their faults went through shmem_get_folio: perf, a 1.7B first start)
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    return np.frombuffer(mmap.mmap(-1, n, flags=private) if private else mmap.mmap(-1, n), np.uint8)


LIBRARIES: dict[str, NativeLibrary] = {}
# the modules that own a kernel, each registering its library on import
KERNEL_MODULES = ("q4", "q8", "ops", "paged_attention", "head8")


def register(lib: NativeLibrary) -> NativeLibrary:
    """Record a kernel's library for `--build` (each kernel module registers its own)."""
    LIBRARIES[lib.name] = lib
    return lib


def kernel_libraries() -> dict[str, NativeLibrary]:
    """Every kernel's library, by name."""
    import importlib

    for module in KERNEL_MODULES:
        importlib.import_module(f"batchmlx.engine.host.{module}")
    # the kernels register with the package's module, not with `python -m`'s __main__ copy
    return dict(importlib.import_module("batchmlx.engine.host.native_lib").LIBRARIES)


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--build":
        print("usage: python -m batchmlx.engine.host.native_lib --build [NAME ...]")
        return 2
    libraries = kernel_libraries()
    for name in argv[1:] or sorted(libraries):
        print(libraries[name].build())
    return 0


if __name__ == "__main__":
    # the kernel modules register into the imported module, not this __main__ copy of it
    from batchmlx.engine.host import native_lib

    sys.exit(native_lib.main(sys.argv[1:]))
