"""The 8-bit head (engine/host/head8.py, native/head8.c): int8 weights in groups of 32 against
bf16 activations. Its product against float64, a row's logits the same bits whatever the batch,
its place or the thread split, a Q8_0 table's own values kept (in the GEMM and the embedding's
lookups, one copy), and the int8 format's head and embedding built on it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from batchmlx.engine.host import head8, q8, quantized
from batchmlx.engine.host.linear import (
    HostEmbedding,
    HostFormat,
    SharedGemm,
    runs_here,
    to_host_format,
)
from batchmlx.engine.host.native_lib import widened
from tests.engine.helpers import bf16_bits, random_llama

needs_kernel = pytest.mark.skipif(not head8.available(), reason="no AVX-512 BF16 here")
# the path this process takes at every width, and the other where this CPU has both (each is
# batch-invariant on its own; the two differ in their last bits: head8.c)
PATHS = [False, True] if head8.available() and head8.amx() else [False]


def _q8_0(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random Q8_0-like values q (|q| <= 127) and float16-exact scales [N, K / 32]."""
    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, (n, k)).astype(np.int8)
    d = rng.uniform(0.001, 0.02, (n, k // 32)).astype(np.float16).astype(np.float32)
    return q, d


def _dequantized(q: np.ndarray, d: np.ndarray) -> np.ndarray:
    n, k = q.shape
    return (q.reshape(n, -1, 32).astype(np.float32) * d[:, :, None]).reshape(n, k)


def _run(x: np.ndarray, w: head8.Head8Weights, threads: int = 1, pool=None,
         amx: bool | None = None) -> np.ndarray:  # fmt: skip
    out = np.full((x.shape[0], w.n), np.nan, np.float32)
    head8.matmul(x, w, out, threads=threads, pool=pool, use_amx=amx)
    return out


def _rows(m: int, k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((m, k)).astype(np.float32)


@needs_kernel
@pytest.mark.parametrize("amx", PATHS, ids=lambda a: "amx" if a else "avx512")
@pytest.mark.parametrize(("m", "n", "k"), [(1, 16, 32), (7, 80, 96), (13, 144, 576),
                                           (21, 208, 1152), (40, 64, 64)])  # fmt: skip
def test_the_product_against_float64(m: int, n: int, k: int, amx: bool) -> None:
    q, d = _q8_0(n, k, 1)
    w = head8.Head8Weights.pack(q, d)
    x = _rows(m, k, 2)
    got = _run(x, w, amx=amx)
    # the definition: x rounded to bf16 (nearest even), the weights q * d exactly
    xb = bf16_bits(x)
    assert np.array_equal(head8.to_bf16(x), xb)
    x64 = (xb.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    exact = x64 @ _dequantized(q, d).astype(np.float64).T
    # float32 sums, a group at a time: within a few float32 roundings of the largest
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-6 * np.abs(exact).max())


@needs_kernel
@pytest.mark.parametrize("amx", PATHS, ids=lambda a: "amx" if a else "avx512")
def test_a_row_is_the_same_alone_in_any_batch_at_any_place_and_split(amx: bool) -> None:
    k, n = 576, 1040  # 65 column tiles: blocks of 4 (and AMX's 2) with a tail
    w = head8.Head8Weights.pack(*_q8_0(n, k, 5))
    rows = _rows(70, k, 6)
    alone = np.stack([_run(rows[i : i + 1], w, amx=amx)[0] for i in range(len(rows))])
    with ThreadPoolExecutor(3) as pool:
        # row blocks of 6 (AVX-512) and tiles of 16, 32 (AMX), their tails, a lone row
        for m in (2, 5, 6, 7, 13, 16, 17, 33, 37, 64, 70):
            for threads in (1, 2, 4):
                got = _run(rows[:m], w, threads, lambda: pool, amx)
                assert np.array_equal(got, alone[:m]), (m, threads)
        shuffled = np.random.default_rng(7).permutation(70)
        got = _run(rows[shuffled], w, 2, lambda: pool, amx)
        assert np.array_equal(got, alone[shuffled])
    # a row among 37 others, wherever it stands
    for at in (0, 18, 37):
        batch = np.insert(_rows(37, k, 8), at, rows[3], axis=0)
        assert np.array_equal(_run(batch, w, amx=amx)[at], alone[3])
    assert _run(rows[:0], w, amx=amx).shape == (0, n)  # no rows: nothing read or written
    wide = np.zeros((70, k + 32), np.float32)  # rows read through a wider array
    wide[:, 16 : 16 + k] = rows
    assert np.array_equal(_run(wide[:, 16 : 16 + k], w, amx=amx), alone)


@needs_kernel
@pytest.mark.skipif(q8.pool_runner() is None, reason="q8's pool does not run on this CPU")
@pytest.mark.parametrize("amx", PATHS, ids=lambda a: "amx" if a else "avx512")
def test_on_the_gemm_workers_a_row_keeps_its_bits(amx: bool, monkeypatch) -> None:
    """Split on q8's GEMM workers (units of 64 columns, claims of 1 unit to all of them, 2-3
    threads, a tail unit of 16 columns), every row keeps one thread's bits; and the worker did
    take units (its help counter moved)."""
    monkeypatch.setattr(head8, "SPLIT_MACS", 0)
    # 17 units of 64 columns, the last of 16; K = 2,048 (a 1.7B's): each path's widened
    # weights on the worker's stack, 256 KB (pool.h's workers once had 256 KB: SIGSEGV)
    k, n = 2048, 1040
    w = head8.Head8Weights.pack(*_q8_0(n, k, 11))
    rows = _rows(37, k, 12)
    runner = q8.pool_runner()

    def pooled(x: np.ndarray, threads: int) -> np.ndarray:
        out = np.full((x.shape[0], n), np.nan, np.float32)
        head8.matmul(x, w, out, threads=threads, runner=runner, use_amx=amx)
        return out

    helped = q8.pool_workers()[1]
    for m in (1, 5, 17, 37):
        alone = _run(rows[:m], w, amx=amx)
        for chunks in (1, 4, 100):  # claims of 8, 2 and 1 unit(s) at 2 threads
            monkeypatch.setattr(head8, "CHUNKS", chunks)
            for threads in (2, 3):
                assert np.array_equal(pooled(rows[:m], threads), alone), (m, chunks, threads)
    # a sleeping worker wakes later than these short calls end: it takes units once it spins
    for _ in range(200):
        if q8.pool_workers()[1] > helped:
            break
        pooled(rows, 2)
    assert q8.pool_workers()[1] > helped


@needs_kernel
def test_a_q8_0_table_keeps_the_files_values_and_adopts_back() -> None:
    q, d = _q8_0(48, 96, 10)
    # as the GGUF converter stores Q8_0 (engine/models/gguf/affine.py): q + 128, bias -128 d
    stored = (quantized.pack((q.astype(np.int16) + 128).astype(np.uint8), 8), d, d * -128)
    w = head8.Head8Weights.of_q8_0(*stored)
    assert w is not None
    back_q, back_d = w.unpacked()
    assert np.array_equal(back_q, q) and np.array_equal(back_d, d)
    # its rows: the values MLX's dequantization of the stored table gives, bit for bit
    ids = np.array([0, 17, 47, 17])
    file_values = quantized.dequantize(*stored, 8, 32)
    assert np.array_equal(head8.rows(w, ids), file_values[ids])
    # another 8-bit affine table (min/max, as a requantized Q6_K) is not taken as Q8_0
    assert head8.Head8Weights.of_q8_0(stored[0], d, d * -127) is None
    again = head8.Head8Weights.adopt(w.values.copy(), w.scales.copy(), 48, 96)
    assert again is not None and head8.Head8Weights.adopt(w.values, w.scales[:-1], 48, 96) is None
    x = _rows(3, 96, 12)
    assert np.array_equal(_run(x, w), _run(x, again))


@needs_kernel
def test_float_weights_round_per_group_and_a_nan_group_shows() -> None:
    w = _rows(32, 64, 13) * 0.1
    w[5, :32] = 0.0  # an all-zero group: zeros
    w[9, 40] = np.nan
    q, s = head8.Head8Weights.of_float(w).unpacked()
    assert np.abs(q).max() == 127 and np.array_equal(q[5, :32], np.zeros(32, np.int8))
    err = np.delete(np.abs(_dequantized(q, s) - w), 9, axis=0)  # half a step at most
    assert (err <= np.repeat(np.delete(s, 9, axis=0), 32, axis=1) * 0.5001).all()
    assert np.isnan(s[9, 1]) and np.array_equal(q[9, 32:], np.zeros(32, np.int8))
    y = _run(_rows(2, 64, 14), head8.Head8Weights.of_float(w))
    assert np.isnan(y[:, 9]).all() and np.isfinite(np.delete(y, 9, axis=1)).all()


@needs_kernel
@pytest.mark.parametrize("kind", ["float32", "bf16", "float16"])
def test_a_float_table_rounds_in_c_as_numpy_rounds_it(kind: str) -> None:
    """A first start rounds a float head in head8.c, straight into its layout, from the
    table as it lies: the same bits as round_groups (numpy) on its float32."""
    w = _rows(48, 96, 16) * 0.2
    w[3, :32] = 0.0
    w[7, 50] = np.nan
    w[8, 95] = np.inf
    table = {"float32": w, "bf16": bf16_bits(w), "float16": w.astype(np.float16)}[kind]
    got = head8.Head8Weights.of_float(table)
    q, s = head8.round_groups(widened(table))
    ref = head8.Head8Weights.pack(q, s)
    assert np.array_equal(got.values, ref.values)
    assert np.array_equal(got.scales, ref.scales, equal_nan=True)
    assert np.isnan(s).sum() == 2 and (s[3, 0] == 0)


def _tied_q8_0_llama(vocab: int = 112) -> tuple[nn.Module, np.ndarray, np.ndarray]:
    """The tiny llama with its tied embedding a Q8_0 table (as a converted GGUF holds it)."""
    model = random_llama(vocab_size=vocab)
    emb = nn.QuantizedEmbedding(vocab, 64, group_size=32, bits=8)
    q, d = _q8_0(vocab, 64, 15)
    emb.weight = mx.array(quantized.pack((q.astype(np.int16) + 128).astype(np.uint8), 8))
    emb.scales, emb.biases = mx.array(d), mx.array(d * -128)
    model.model.embed_tokens = emb
    return model, q, d


@needs_kernel
@pytest.mark.skipif(not runs_here(HostFormat.INT8), reason="no int8 host format here")
def test_the_int8_formats_head_is_the_q8_0_table_itself_held_once() -> None:
    model, q, d = _tied_q8_0_llama()
    to_host_format(model, HostFormat.INT8)
    emb = model.model.embed_tokens
    assert isinstance(emb, HostEmbedding) and emb._gemm.fmt is HostFormat.W8
    back_q, back_d = emb._h8.unpacked()
    assert np.array_equal(back_q, q) and np.array_equal(back_d, d)
    assert emb.weight is emb._gemm.packed  # the lookups' table is the head's
    ids = mx.array([[3, 0, 111], [7, 7, 50]])
    assert np.array_equal(np.array(emb(ids)), _dequantized(q, d)[np.array(ids)])
    # the tied head through MLX's path: the kernel's product of the bf16-rounded input
    x = mx.random.normal((2, 5, 64))
    got = np.array(emb.as_linear(x))
    want = np.empty((10, 112), np.float32)
    head8.matmul(bf16_bits(np.array(x).reshape(10, 64)), emb._h8, want)
    assert np.array_equal(got.reshape(10, 112), want)


@needs_kernel
def test_a_head_the_kernel_cannot_take_stays_bf16() -> None:
    w = mx.array(_rows(97, 64, 16))  # 97 rows: not a multiple of 16
    gemm = SharedGemm([w], HostFormat.W8)
    assert gemm.fmt in (HostFormat.BF16, HostFormat.F32) and gemm._h8 is None
