"""engine/host/elf.py on the real vendored libraries: a renamed copy is what a DT_NEEDED of the
new name finds inside a running process, and what cannot be renamed is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from batchmlx.engine.host import elf
from batchmlx.engine.host import fast_blas as accel

NUMPY_LIBS = Path(np.__file__).resolve().parent.parent / "numpy.libs"
GFORTRAN = sorted(NUMPY_LIBS.glob("libgfortran-*.so*"))
needs_vendored = pytest.mark.skipif(not GFORTRAN, reason="numpy vendors no libgfortran here")


@needs_vendored
def test_a_copy_reads_the_new_soname_and_the_original_is_untouched(tmp_path: Path) -> None:
    src = GFORTRAN[0]
    theirs = elf.soname(src)
    assert theirs.startswith("libgfortran-")  # auditwheel's hashed name
    elf.copy_with_soname(src, tmp_path / "libgfortran.so.5", "libgfortran.so.5")
    assert elf.soname(tmp_path / "libgfortran.so.5") == "libgfortran.so.5"
    assert elf.soname(src) == theirs
    assert (tmp_path / "libgfortran.so.5").stat().st_size == src.stat().st_size


@needs_vendored
def test_a_longer_name_or_a_file_that_is_no_library_is_refused(tmp_path: Path) -> None:
    with pytest.raises(elf.ElfError, match="longer"):
        elf.copy_with_soname(GFORTRAN[0], tmp_path / "x.so", "lib" + "x" * 80 + ".so")
    (tmp_path / "empty.so").write_bytes(b"")
    with pytest.raises(elf.ElfError):
        elf.soname(tmp_path / "empty.so")
    assert not elf.renamed_copy(tmp_path / "empty.so", tmp_path / "libgfortran.so.5")


@needs_vendored
def test_the_renamed_copy_satisfies_a_dependency_by_that_name_in_process(tmp_path: Path) -> None:
    """OpenBLAS (cmeel) needs libgfortran.so.5: after the runtime folder's libraries are loaded
    with RTLD_GLOBAL, a fresh process loads it with no LD_LIBRARY_PATH and no system copy."""
    folder = accel.fortran_runtime_dir(tmp_path / "cache")
    assert folder is not None
    copy = folder / "libgfortran.so.5"
    assert not copy.is_symlink() and elf.soname(copy) == "libgfortran.so.5"
    assert elf.renamed_copy(GFORTRAN[0], copy)  # up to date: left as it is
    blas = next((p for p in accel._default_openblas_candidates() if p.exists()), None)
    if blas is None:
        pytest.skip("no cmeel-openblas here")
    code = (
        "import ctypes, sys\n"
        f"for p in {[str(p) for p in sorted(folder.iterdir())]!r}:\n"
        "    ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL)\n"
        f"lib = ctypes.CDLL({str(blas)!r})\n"
        "print(bool(lib.cblas_sgemm))\n"
    )
    env = {"PATH": "/usr/bin:/bin"}  # no LD_LIBRARY_PATH, no LD_PRELOAD
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == "True", out.stderr
