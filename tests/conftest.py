"""Suite-wide set-up: run the tests on the fast BLAS, as the `batchmlx` command does."""

from __future__ import annotations


def pytest_configure(config) -> None:
    # MLX's Linux CPU wheel links a reference BLAS; batchmlx preloads an optimized one by
    # re-executing the process once (batchmlx.accel). Do the same for pytest, before any test
    # imports MLX, so the engine tests run at the speed users get. No-op where none is found.
    from batchmlx.accel import ensure_fast_blas

    ensure_fast_blas()
