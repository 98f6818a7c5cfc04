"""A shared library's DT_SONAME, read and rewritten in a copy (engine/host/fast_blas.py).

Wheels vendor their runtime libraries under hashed names (numpy's `libgfortran-040039e1-….so`,
sentencepiece's `libgomp-6a29c32d-….so`), and so under hashed sonames. The dynamic linker
matches a library's DT_NEEDED entry (`libgfortran.so.5`) against the sonames of what is already
loaded, so a copy of the vendored file whose soname reads `libgfortran.so.5`, loaded first with
RTLD_GLOBAL, satisfies OpenBLAS's dependency inside a running process, where LD_LIBRARY_PATH
(read once, at process start) no longer can. The new name is written over the old one in the
string table (it must be no longer), so nothing else in the file moves.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

_PT_LOAD, _PT_DYNAMIC = 1, 2
_DT_NULL, _DT_STRTAB, _DT_SONAME = 0, 5, 14


class ElfError(ValueError):
    """Not a 64-bit little-endian shared library with a soname."""


def _soname_offset(data: bytes | bytearray) -> int:
    """The file offset of the soname string in `data`, a 64-bit little-endian ELF file."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ElfError("not a 64-bit little-endian ELF file")
    (phoff,) = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    dynamic, loads = None, []
    for i in range(phnum):
        at = phoff + i * phentsize
        kind, _, offset, vaddr, _, filesz = struct.unpack_from("<IIQQQQ", data, at)
        if kind == _PT_DYNAMIC:
            dynamic = (offset, filesz)
        elif kind == _PT_LOAD:
            loads.append((vaddr, offset, filesz))
    if dynamic is None:
        raise ElfError("no dynamic section")
    strtab = soname = None
    for at in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, value = struct.unpack_from("<qQ", data, at)
        if tag == _DT_NULL:
            break
        strtab = value if tag == _DT_STRTAB else strtab
        soname = value if tag == _DT_SONAME else soname
    if strtab is None or soname is None:
        raise ElfError("no soname")
    for vaddr, offset, size in loads:  # the string table's address -> its place in the file
        if vaddr <= strtab < vaddr + size:
            return strtab - vaddr + offset + soname
    raise ElfError("the string table lies outside the loaded segments")


def soname(path: Path) -> str:
    """The DT_SONAME of the library at `path` (ElfError where it has none)."""
    data = path.read_bytes()
    at = _soname_offset(data)
    return data[at : data.index(b"\0", at)].decode()


def copy_with_soname(src: Path, dst: Path, name: str) -> None:
    """Write a copy of `src` at `dst` (atomically) whose soname reads `name`; ElfError where
    `src` has no soname or `name` is longer than its own."""
    data = bytearray(src.read_bytes())
    at = _soname_offset(data)
    old = data.index(b"\0", at) - at
    if len(name) > old:
        raise ElfError(f"the soname {name!r} is longer than the file's own ({old} bytes)")
    data[at : at + old] = name.encode().ljust(old, b"\0")
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}")
    tmp.write_bytes(data)
    tmp.chmod(0o755)
    tmp.replace(dst)  # a concurrent process sees the old file or the new one


def renamed_copy(target: Path, dst: Path) -> bool:
    """`dst` made (or found up to date) as a copy of `target` whose soname is dst's name; False
    where `target` cannot be renamed so (a link to it then serves LD_LIBRARY_PATH alone)."""
    src = target.stat()
    if not dst.is_symlink() and dst.is_file():
        mine = dst.stat()
        if (mine.st_size, mine.st_mtime_ns) == (src.st_size, src.st_mtime_ns):
            return True
    try:
        copy_with_soname(target, dst, dst.name)
    except ElfError:
        return False
    os.utime(dst, ns=(src.st_atime_ns, src.st_mtime_ns))  # what tells the copy up to date
    return True
