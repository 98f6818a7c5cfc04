"""The thread count of numpy's own BLAS (the OpenBLAS its wheel vendors, a library apart from
the one MLX's matmuls may preload), set through its C entry point.

The host kernels use it two ways: attention's tiles run on two worker threads, each calling
numpy's BLAS for small matmuls, which must stay single-threaded (two thread teams on two
cores spin against each other: a 1,000-token prefill 1.2 s -> 2.3 s); the float32 host
format's GEMMs (host_linear.py) want every thread the engine has, for the length of the call
(W=8 decode step GEMMs at 135M: 113 ms on one thread, 58 on two). Setting the count costs
nothing measurable (2,000 toggles around a GEMM: no change), so a GEMM raises it and drops it
back. Without the entry point (another numpy build) calls do nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

_NAMES = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
          "openblas_set_num_threads64_", "openblas_set_num_threads")  # fmt: skip
_setter: Callable[[int], None] | None = None
_found = False


def _find() -> Callable[[int], None] | None:
    global _setter, _found
    if _found:
        return _setter
    _found = True
    libs = Path(np.__file__).resolve().parent.parent / "numpy.libs"
    for lib in sorted(libs.glob("libscipy_openblas*.so*")):
        try:
            handle = ctypes.CDLL(str(lib))
        except OSError:  # pragma: no cover - unloadable: leave numpy's BLAS as it is
            continue
        for name in _NAMES:
            fn = getattr(handle, name, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_int]
                _setter = fn
                return _setter
    return None


def set_threads(n: int) -> None:
    """numpy's BLAS to `n` threads (where its entry point is found)."""
    fn = _find()
    if fn is not None:
        fn(max(1, int(n)))


@contextmanager
def threads(n: int) -> Iterator[None]:
    """numpy's BLAS on `n` threads for the block, single-threaded after (host_attention's
    setting)."""
    set_threads(n)
    try:
        yield
    finally:
        set_threads(1)
