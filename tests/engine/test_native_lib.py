"""The host backend's C kernels ship prebuilt: each library must be the build of its source."""

from __future__ import annotations

import ctypes
import platform
import sys

import pytest

from batchmlx.engine.host.native_lib import kernel_libraries

LINUX_X86 = sys.platform.startswith("linux") and platform.machine() == "x86_64"


@pytest.mark.skipif(not LINUX_X86, reason="the libraries are built for x86-64 Linux")
@pytest.mark.parametrize("name", sorted(kernel_libraries()))
def test_each_shipped_library_was_built_from_the_shipped_source(name: str) -> None:
    # loading runs none of the kernels' vector code: this holds on any x86-64 CPU
    lib = kernel_libraries()[name]
    handle = ctypes.CDLL(str(lib.path))
    answer = getattr(handle, f"{name}_source_sha")
    answer.restype = ctypes.c_char_p
    assert answer().decode() == lib.source_sha(), (
        f"python -m batchmlx.engine.host.native_lib --build {name}"
    )


def test_a_library_built_from_another_source_is_refused(tmp_path, monkeypatch) -> None:
    from batchmlx.engine.host import native_lib

    q8 = kernel_libraries()["q8"]
    if not native_lib.cpu_has(q8.cpu_flags) or not LINUX_X86:
        pytest.skip("no AVX-512 VNNI here")
    for path in q8.sources():  # q8.c and the headers it includes
        (tmp_path / path.name).write_bytes(path.read_bytes())
    changed = tmp_path / "q8.c"
    changed.write_text(q8.source.read_text() + "\n/* changed */\n")
    (tmp_path / q8.path.name).write_bytes(q8.path.read_bytes())
    monkeypatch.setattr(native_lib, "NATIVE", tmp_path)
    assert native_lib.NativeLibrary("q8", q8.cpu_flags, q8.target_flags, "test").load() is None


def test_a_library_built_before_a_header_it_includes_changed_is_refused(tmp_path, monkeypatch):
    from batchmlx.engine.host import native_lib

    libraries = kernel_libraries()
    # q8 and q4 share native/grouped.h and native/pool.h (q8 and head8 native/widen.h; attn,
    # ops and head8 native/runner.h): each hash covers what its source includes
    assert [p.name for p in libraries["q4"].sources()] == ["q4.c", "grouped.h", "pool.h"]
    assert [p.name for p in libraries["q8"].sources()] == ["q8.c", "grouped.h", "pool.h", "widen.h"]
    assert [p.name for p in libraries["head8"].sources()] == ["head8.c", "runner.h", "widen.h"]
    assert [p.name for p in libraries["ops"].sources()] == ["ops.c", "runner.h"]
    assert [p.name for p in libraries["attn"].sources()] == ["attn.c", "runner.h", "attn_amx.h"]
    q8 = libraries["q8"]
    if not native_lib.cpu_has(q8.cpu_flags) or not LINUX_X86:
        pytest.skip("no AVX-512 VNNI here")
    for path in q8.sources():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    (tmp_path / q8.path.name).write_bytes(q8.path.read_bytes())
    # (load is cached by the library's fields: `what` tells this one from other tests')
    copy = native_lib.NativeLibrary("q8", q8.cpu_flags, q8.target_flags, "test (same)")
    shipped = q8.source_sha()
    monkeypatch.setattr(native_lib, "NATIVE", tmp_path)
    assert copy.source_sha() == shipped
    assert copy.load() is not None  # the same sources: the shipped library is theirs
    with (tmp_path / "pool.h").open("a") as header:
        header.write("\n/* changed */\n")
    changed = native_lib.NativeLibrary("q8", q8.cpu_flags, q8.target_flags, "test (changed)")
    assert changed.source_sha() != shipped
    assert changed.load() is None
    (tmp_path / "grouped.h").unlink()  # a header missing: refused, not an error at start
    missing = native_lib.NativeLibrary("q8", q8.cpu_flags, q8.target_flags, "test (missing)")
    assert missing.load() is None
