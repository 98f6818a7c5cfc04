"""The grouped int8 kernel (engine/host/q8.py, native/q8.c): built from its source, the exact
product of the grouped quantized operands, and a row's result the same whatever the batch,
its place in it, the thread split or the row stride."""

from __future__ import annotations

import ctypes
import platform
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from batchmlx.engine.host import q8
from tests.engine.helpers import grouped_exact

LINUX_X86 = sys.platform.startswith("linux") and platform.machine() == "x86_64"
needs_kernel = pytest.mark.skipif(not q8.available(), reason="no AVX-512 VNNI here")


@pytest.mark.skipif(not LINUX_X86, reason="the library is built for x86-64 Linux")
def test_the_shipped_library_was_built_from_the_shipped_source() -> None:
    # loading runs none of its AVX-512 code: this holds on any x86-64 CPU
    lib = ctypes.CDLL(str(q8.LIBRARY))
    lib.q8_source_sha.restype = ctypes.c_char_p
    assert lib.q8_source_sha().decode() == q8.source_sha(), (
        "python -m batchmlx.engine.host.q8 --build"
    )


def _rand(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _run(x: np.ndarray, w: q8.Q8Weights, threads: int = 1, pool=None) -> np.ndarray:
    out = np.full((x.shape[0], w.n), np.nan, np.float32)
    q8.matmul(x, w, out, threads=threads, pool=pool)
    return out


@needs_kernel
@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 64), (7, 80, 96), (13, 144, 576), (3, 64, 1536)])
def test_the_product_of_the_grouped_quantized_operands(m: int, n: int, k: int) -> None:
    x, w = _rand((m, k), 1), _rand((n, k), 2, 0.05)
    got = _run(x, q8.Q8Weights.pack(w))
    exact = grouped_exact(x, w)
    # float32 scale products and one FMA per group: within a few float32 roundings
    np.testing.assert_allclose(got, exact, rtol=2e-6, atol=2e-6 * np.abs(exact).max())
    # and the quantization's error of the float product: Q8_0-like, about 0.5% here
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 0.02


@needs_kernel
def test_activations_quantized_in_the_kernel_as_in_numpy() -> None:
    x = _rand((5, 160), 4)
    x[2, 64:128] = 0.0  # an all-zero group: scale 1
    lib = q8.library()
    xq = np.empty(x.shape, np.uint8)
    xs = np.empty((5, q8.groups(160)), np.float32)
    lib.q8_quantize(5, 160, q8.GROUP, x.ctypes.data, 160, xq.ctypes.data, xs.ctypes.data)
    q, s = q8.quantize_groups(x)
    assert np.array_equal(xq.astype(np.int16) - 128, q) and np.array_equal(xs, s)


@needs_kernel
def test_a_row_is_the_same_alone_in_any_batch_at_any_place_and_split() -> None:
    k, n = 576, 960
    w = q8.Q8Weights.pack(_rand((n, k), 5, 0.05))
    rows = _rand((70, k), 6)
    alone = np.stack([_run(rows[i : i + 1], w)[0] for i in range(len(rows))])
    with ThreadPoolExecutor(3) as pool:
        for m in (2, 5, 6, 7, 13, 64, 70):  # row blocks of 6 and their tails
            for threads in (1, 2, 4):
                got = _run(rows[:m], w, threads, lambda: pool)
                assert np.array_equal(got, alone[:m]), (m, threads)
        shuffled = np.random.default_rng(7).permutation(70)
        got = _run(rows[shuffled], w, 2, lambda: pool)
        assert np.array_equal(got, alone[shuffled])
    # rows read through a wider array (the host step's slabs)
    wide = np.zeros((70, k + 32), np.float32)
    wide[:, 16 : 16 + k] = rows
    assert np.array_equal(_run(wide[:, 16 : 16 + k], w), alone)


@needs_kernel
def test_a_row_holding_nan_shows_it_and_leaves_the_others_alone() -> None:
    k, n = 128, 32
    w = q8.Q8Weights.pack(_rand((n, k), 8, 0.05))
    x = _rand((4, k), 9)
    clean = _run(x, w)
    x[2, 70] = np.nan
    got = _run(x, w)
    assert np.isnan(got[2]).all()
    assert np.array_equal(np.delete(got, 2, axis=0), np.delete(clean, 2, axis=0))


@needs_kernel
def test_packed_bytes_adopted_back_compute_the_same() -> None:
    w = q8.Q8Weights.pack(_rand((48, 192), 10))
    again = q8.Q8Weights.adopt(w.buffer.copy(), 48, 192)
    assert again is not None and q8.Q8Weights.adopt(w.buffer[:-4], 48, 192) is None
    x = _rand((3, 192), 11)
    assert np.array_equal(_run(x, w), _run(x, again))
