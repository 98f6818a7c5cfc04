"""The paged decode-attention kernel (native/attn.c): against a float64 reference, and a row's
bits whatever the other rows, the split over threads and the cascade's loop order."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from batchmlx.engine.host import paged_attention as pa
from batchmlx.engine.host import q8

pytestmark = pytest.mark.skipif(pa.library() is None, reason="kernel does not run on this CPU")

BS = 16


def _case(seed: int, rows: int, h: int = 3, rep: int = 3, d: int = 64, shared: int = 0,
          max_keys: int = 200, blocks: int = 64):  # fmt: skip
    """A random pool [blocks * H * BS, D] and rows with ragged lengths and shuffled tables
    (the first `shared` blocks of each the same ones)."""
    rng = np.random.default_rng(seed)
    kpool = rng.standard_normal((blocks * h * BS, d), dtype=np.float32)
    vpool = rng.standard_normal((blocks * h * BS, d), dtype=np.float32)
    q = rng.standard_normal((rows, h * rep, d), dtype=np.float32) * np.float32(0.3)
    counts = rng.integers(shared * BS + 1, max_keys + 1, rows)
    width = -(-int(counts.max()) // BS)
    prefix = rng.permutation(np.arange(1, blocks))[:shared]
    tables = np.zeros((rows, width), np.int32)
    for r in range(rows):
        own = rng.permutation(np.arange(1, blocks))[: width - shared]
        tables[r] = np.concatenate([prefix, own])
    return q, kpool, vpool, pa.DecodeRows.of(tables, counts, shared), h


def _reference(q, kpool, vpool, rows: pa.DecodeRows, h: int, window=None, softcap=None):
    """float64 softmax attention over each row's keys, gathered through its table."""
    r, hq, d = q.shape
    rep = hq // h
    kp = kpool.astype(np.float64).reshape(-1, h, BS, d)
    vp = vpool.astype(np.float64).reshape(-1, h, BS, d)
    out = np.empty((r, hq, d))
    for i in range(r):
        n = int(rows.counts[i])
        blocks = rows.tables[i][: -(-n // BS)]
        k = kp[blocks].transpose(1, 0, 2, 3).reshape(h, -1, d)[:, :n]
        v = vp[blocks].transpose(1, 0, 2, 3).reshape(h, -1, d)[:, :n]
        lo = max(0, n - window) if window else 0
        for head in range(hq):
            s = k[head // rep, lo:] @ q[i, head].astype(np.float64)
            if softcap:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            out[i, head] = p @ v[head // rep, lo:] / p.sum()
    return out


@pytest.mark.parametrize(
    ("shape", "window", "softcap"),
    [(dict(h=3, rep=3, d=64), None, None), (dict(h=2, rep=4, d=128), None, None),
     (dict(h=1, rep=1, d=32), 40, None), (dict(h=2, rep=2, d=64), None, 5.0),
     (dict(h=3, rep=3, d=64, shared=5), None, None)],
)  # fmt: skip
def test_kernel_matches_a_float64_reference(shape, window, softcap):
    q, kp, vp, rows, h = _case(1, rows=9, **shape)
    got = pa.decode(q, kp, vp, rows, h, BS, window=window, softcap=softcap)
    want = _reference(q, kp, vp, rows, h, window, softcap)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


amx_only = pytest.mark.skipif(not pa.amx(), reason="no AMX-BF16 tiles here")


def _prompt(rows: pa.DecodeRows, shared: int | None = None) -> pa.DecodeRows:
    """The same rows as prompt queries (DecodeRows.tiles)."""
    return pa.DecodeRows.of(rows.tables, rows.counts, rows.shared if shared is None else shared,
                            tiles=True)  # fmt: skip


def _chunks(seed: int, chunks: int, h: int = 3, rep: int = 3, d: int = 64, prefix: int = 5,
            blocks: int = 80):  # fmt: skip
    """Prompt chunks of a step behind one shared prefix of `prefix` blocks: each chunk's
    queries a row each, their sequence's table and the keys up to their own position."""
    rng = np.random.default_rng(seed)
    kpool = rng.standard_normal((blocks * h * BS, d), dtype=np.float32).astype(np.float16)
    vpool = rng.standard_normal((blocks * h * BS, d), dtype=np.float32).astype(np.float16)
    ids = rng.permutation(np.arange(1, blocks))
    tables, counts, at = [], [], prefix
    for _ in range(chunks):
        own = ids[at : at + 4]
        at += 4
        start, n = prefix * BS + int(rng.integers(0, 20)), int(rng.integers(1, 40))
        for i in range(n):
            tables.append(np.concatenate([ids[:prefix], own]))
            counts.append(start + i + 1)
    q = rng.standard_normal((len(counts), h * rep, d), dtype=np.float32) * np.float32(0.3)
    rows = pa.DecodeRows.of(np.array(tables), np.array(counts), prefix, tiles=True)
    return q, kpool, vpool, rows, h


@amx_only
@pytest.mark.parametrize(
    ("shape", "window", "softcap", "dtype"),
    [(dict(h=3, rep=3, d=64), None, None, np.float16),
     (dict(h=3, rep=3, d=64), None, None, np.float32),
     (dict(h=2, rep=4, d=128), None, None, np.float16),
     (dict(h=1, rep=1, d=32), 40, None, np.float16), (dict(h=2, rep=2, d=64), 70, 5.0, np.float16),
     (dict(h=3, rep=3, d=64, shared=5), None, None, np.float16)],
)  # fmt: skip
def test_prompt_rows_through_tiles_match_a_float64_reference(shape, window, softcap, dtype):
    """The tile path (prompt queries, attn_amx.h) against float64: its bf16 halves keep ~16
    bits of each product, so within ~1e-4, where a broken tile layout is off by ~1."""
    q, kp, vp, rows, h = _case(1, rows=9, **shape)
    kp, vp = kp.astype(dtype), vp.astype(dtype)
    got = pa.decode(q, kp, vp, _prompt(rows), h, BS, window=window, softcap=softcap)
    want = _reference(q, kp, vp, rows, h, window, softcap)
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=3e-4)
    assert not np.array_equal(got, pa.decode(q, kp, vp, rows, h, BS, window=window,
                                             softcap=softcap))  # fmt: skip


@amx_only
@pytest.mark.skipif(q8.pool_runner() is None, reason="q8's pool does not run on this CPU")
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (50, 30.0)])
def test_a_prompt_rows_bits_are_its_own_through_tiles(window, softcap):
    """A prompt query's bits through tiles do not depend on the rows sharing its tiles or
    claim: 9 chunks behind one prefix in one call, each chunk alone, each row alone, the rows
    reversed, without the cascade, split over threads and claims of any size."""
    q, kp, vp, rows, h = _chunks(11, chunks=9)
    kw = dict(window=window, softcap=softcap)
    full = pa.decode(q, kp, vp, rows, h, BS, **kw)
    n = len(rows.counts)
    assert np.array_equal(pa.decode(q, kp, vp, _prompt(rows, 0), h, BS, **kw), full)
    order = np.arange(n)[::-1]
    back = pa.DecodeRows.of(rows.tables[order], rows.counts[order], rows.shared, tiles=True)
    assert np.array_equal(pa.decode(q[order], kp, vp, back, h, BS, **kw)[::-1], full)
    for i in (0, n // 2, n - 1):
        alone = pa.DecodeRows.of(rows.tables[i : i + 1], rows.counts[i : i + 1], tiles=True)
        assert np.array_equal(pa.decode(q[i : i + 1], kp, vp, alone, h, BS, **kw)[0], full[i])
    first = rows.tables[:, -1] == rows.tables[0, -1]  # the first chunk's rows
    chunk = pa.DecodeRows.of(rows.tables[first], rows.counts[first], tiles=True)
    assert np.array_equal(pa.decode(q[first], kp, vp, chunk, h, BS, **kw), full[first])
    runner = q8.pool_runner()
    for threads in (2, 3):
        for claims in (1, 4, 100):
            got = _pooled(q, kp, vp, rows, h, window, softcap, runner, threads, claims)
            assert np.array_equal(got, full)


@amx_only
def test_without_tiles_prompt_rows_take_the_vector_path():
    """set_amx(False): prompt rows give the vector path's bits (a process runs one path)."""
    q, kp, vp, rows, h = _chunks(12, chunks=3)
    vector = pa.decode(q, kp, vp, pa.DecodeRows.of(rows.tables, rows.counts, rows.shared), h, BS)
    try:
        assert not pa.set_amx(False)
        assert np.array_equal(pa.decode(q, kp, vp, rows, h, BS), vector)
    finally:
        assert pa.set_amx(True)
    assert not np.array_equal(pa.decode(q, kp, vp, rows, h, BS), vector)


def test_a_row_is_the_same_bits_whatever_the_batch_and_the_split():
    q, kp, vp, rows, h = _case(2, rows=12, max_keys=300)
    full = pa.decode(q, kp, vp, rows, h, BS)
    with ThreadPoolExecutor(3) as pool:
        for ranges in ([(0, 12)], [(0, 1), (1, 12)], [(0, 5), (5, 9), (9, 12)]):
            split = pa.decode(q, kp, vp, rows, h, BS, pool=pool, ranges=ranges)
            assert np.array_equal(split, full)
    for i in (0, 5, 11):  # each row alone, and beside others in another order
        alone = pa.DecodeRows.of(rows.tables[i : i + 1], rows.counts[i : i + 1])
        assert np.array_equal(pa.decode(q[i : i + 1], kp, vp, alone, h, BS)[0], full[i])
    order = np.arange(12)[::-1]
    shuffled = pa.DecodeRows.of(rows.tables[order], rows.counts[order])
    assert np.array_equal(pa.decode(q[order], kp, vp, shuffled, h, BS)[::-1], full)


def test_the_cascade_is_a_loop_order_not_another_computation():
    q, kp, vp, rows, h = _case(3, rows=10, shared=6, max_keys=250)
    cascade = pa.decode(q, kp, vp, rows, h, BS)
    plain = pa.decode(q, kp, vp, pa.DecodeRows.of(rows.tables, rows.counts, 0), h, BS)
    assert np.array_equal(cascade, plain)
    with ThreadPoolExecutor(2) as pool:
        split = pa.decode(q, kp, vp, rows, h, BS, pool=pool, ranges=[(0, 3), (3, 10)])
    assert np.array_equal(split, plain)
    alone = pa.DecodeRows.of(rows.tables[4:5], rows.counts[4:5], 6)
    assert np.array_equal(pa.decode(q[4:5], kp, vp, alone, h, BS)[0], plain[4])


@pytest.mark.skipif(q8.pool_runner() is None, reason="q8's pool does not run on this CPU")
@pytest.mark.parametrize("shared", [0, 4])
def test_the_gemm_workers_parts_give_the_same_bits(shared):
    """Handed to q8's pool by (row, KV head) units, claims of any size (19 units, 4, 1), the rows
    keep the bits of one thread's call, a window, a softcap and a cascade included; and the
    worker did take units (its help counter moved)."""
    q, kp, vp, rows, h = _case(7, rows=13, shared=shared, max_keys=280)
    runner = q8.pool_runner()
    for window, softcap in ((None, None), (40, 30.0)):
        full = pa.decode(q, kp, vp, rows, h, BS, window=window, softcap=softcap)
        helped = q8.pool_workers()[1]
        for threads in (2, 3):
            for claims in (1, 4, 100):
                got = _pooled(q, kp, vp, rows, h, window, softcap, runner, threads, claims)
                assert np.array_equal(got, full)
        # a sleeping worker wakes later than these short calls end (CI saw it take none of
        # them): it takes units once it spins
        for _ in range(200):
            if q8.pool_workers()[1] > helped:
                break
            _pooled(q, kp, vp, rows, h, window, softcap, runner, 2, 100)
        assert q8.pool_workers()[1] > helped


@pytest.mark.skipif(q8.pool_runner() is None, reason="q8's pool does not run on this CPU")
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_a_decode_steps_layer_is_the_scatter_then_the_decode(dtype):
    """DecodeStep.layer (one C call) writes the new keys and values where `scatter` does and
    returns `decode`'s bits over the pool so written."""
    q, kp, vp, rows, h = _case(8, rows=6, shared=2, max_keys=150)
    kp, vp = kp.astype(dtype), vp.astype(dtype)
    rng = np.random.default_rng(9)
    k = rng.standard_normal((6, h, kp.shape[1]), dtype=np.float32)
    v = rng.standard_normal((6, h, kp.shape[1]), dtype=np.float32)
    # each row's last key: its block's row for every head (row (block * H + head) * BS + offset)
    last = rows.counts - 1
    blocks = rows.tables[np.arange(6), last // BS]
    write = ((blocks[:, None] * h + np.arange(h)) * BS + (last % BS)[:, None]).reshape(-1)
    write = pa.WriteRows.of(write.astype(np.int32), kp.shape[0])
    want_k, want_v = kp.copy(), vp.copy()
    pa.scatter(want_k, write, k.reshape(-1, kp.shape[1]))
    pa.scatter(want_v, write, v.reshape(-1, kp.shape[1]))
    want = pa.decode(q, want_k, want_v, rows, h, BS, window=50)
    step = pa.DecodeStep(write, rows, h, BS, q8.pool_runner(), 2)
    got = step.layer(q, k, v, kp, vp, 50, None)
    assert np.array_equal(kp, want_k) and np.array_equal(vp, want_v)
    assert np.array_equal(got, want)


def _pooled(q, kp, vp, rows, h, window, softcap, runner, threads, claims):
    saved = pa.CLAIMS_PER_THREAD
    pa.CLAIMS_PER_THREAD = claims
    try:
        return pa.decode(q, kp, vp, rows, h, BS, window=window, softcap=softcap,
                         runner=runner, threads=threads)  # fmt: skip
    finally:
        pa.CLAIMS_PER_THREAD = saved


def test_splits_cover_every_row_once():
    rows = pa.DecodeRows.of(np.zeros((7, 20), np.int32), np.array([3000, 1, 1, 1, 1, 1, 3000]))
    parts = rows.splits(9, 2)
    assert parts[0][0] == 0 and parts[-1][1] == 7
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:], strict=False))
    assert len(parts) == 2
    assert pa.DecodeRows.of(np.zeros((1, 1), np.int32), np.array([3])).splits(9, 2) == [(0, 1)]


def test_a_float16_pool_is_read_as_its_exact_float32_values():
    """A float16 pool gives the bits of the float32 pool holding the same (rounded) values:
    the kernel widens each element exactly, then runs the same arithmetic."""
    q, kp, vp, rows, h = _case(4, rows=7, shared=3)
    k16, v16 = kp.astype(np.float16), vp.astype(np.float16)
    half = pa.decode(q, k16, v16, rows, h, BS)
    assert np.array_equal(half, pa.decode(q, k16.astype(np.float32), v16.astype(np.float32),
                                          rows, h, BS))  # fmt: skip
    want = _reference(q, k16.astype(np.float32), v16.astype(np.float32), rows, h)
    np.testing.assert_allclose(half, want, rtol=2e-5, atol=2e-6)
    with pytest.raises(ValueError, match="float16 pool"):
        pa.decode(q, k16, vp, rows, h, BS)


@pytest.mark.parametrize("d", [64, 24])
def test_scatter_rounds_as_numpy_and_gather_widens_exactly(d):
    """The pool's writes round float32 to float16 as numpy (and MLX) do, to nearest even,
    infinities, subnormals and overflow included; gathers widen exactly."""
    rng = np.random.default_rng(6)
    src = rng.standard_normal((40, d)).astype(np.float32) * np.float32(100)
    src[0, :8] = [1e-8, -3e-6, 65519.0, 65520.0, 1e6, -np.inf, 2.0**-24, 0.0]
    src[1] = src[1].astype(np.float16).astype(np.float32) + np.float32(2.0**-12)  # ties
    rows = rng.permutation(64)[:40].astype(np.int32)
    for dtype in (np.float16, np.float32):
        pool = np.zeros((64, d), dtype)
        pa.scatter(pool, rows, src)
        want = np.zeros((64, d), dtype)
        with np.errstate(over="ignore"):  # 1e6 overflows float16 to inf: both say so
            want[rows] = src
        assert np.array_equal(pool.view(np.uint8), want.view(np.uint8))
        runs = rng.integers(0, 64, (3, 5))
        assert np.array_equal(pa.gather(pool, runs), pool[runs].astype(np.float32))
