"""The grouped int8 kernel (engine/host/q8.py, native/q8.c): built from its source, the exact
product of the grouped quantized operands, and a row's result the same whatever the batch,
its place in it, the thread split or the row stride."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from batchmlx.engine.host import q8
from batchmlx.engine.host.native_lib import cpu_has
from tests.engine.helpers import bf16_bits, grouped_exact

needs_kernel = pytest.mark.skipif(not q8.available(), reason="no AVX-512 VNNI here")


def _amx_probe() -> int | None:
    """q8_amx_selftest's answer in a child (0 same bits, 1 different, 2 no permission; < 0 the
    signal that ended it: a CPU that traps AMX), None where no AMX is advertised. Not `amx()`:
    that turns a failed self-test into "VNNI only", which would skip the tests below."""
    if not (q8.available() and cpu_has(q8.AMX_FLAGS)):
        return None
    cmd = [sys.executable, "-I", "-c", q8._AMX_PROBE, str(q8.LIBRARY)]
    return subprocess.run(cmd, capture_output=True, timeout=60).returncode


AMX_PROBE = _amx_probe()
# AMX runs here (whatever bits it gives): these tests force it
needs_amx = pytest.mark.skipif(AMX_PROBE not in (0, 1), reason="no AMX that runs here")


def _rand(shape: tuple[int, ...], seed: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def _run(x: np.ndarray, w: q8.Q8Weights, threads: int = 1, amx=None) -> np.ndarray:
    out = np.full((x.shape[0], w.n), np.nan, np.float32)
    q8.matmul(x, w, out, threads=threads, use_amx=amx)
    return out


@pytest.fixture
def split_all(monkeypatch):
    """Every GEMM split over its threads, however small (q8.c's pool, not one thread)."""
    monkeypatch.setattr(q8, "SPLIT_MACS", 0)


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
    m, k = 21, 160
    x = _rand((m, k), 4)
    x[2, 64:128] = 0.0  # an all-zero group: scale 1
    lib = q8.library()
    q, s = q8.quantize_groups_numpy(x)
    # VNNI's: unsigned bytes, x + 128, row by row
    xq = np.empty(x.shape, np.uint8)
    xs = np.empty((m, q8.groups(k)), np.float32)
    lib.q8_quantize(m, k, q8.GROUP, x.ctypes.data, k, xq.ctypes.data, xs.ctypes.data, 0)
    assert np.array_equal(xq.astype(np.int16) - 128, q) and np.array_equal(xs, s)
    # AMX's: signed, in tiles of [16 rows][32] per (row tile, group), the last tile padded;
    # the scales [16 rows] per (row tile, group)
    ng = q8.groups(k)
    xt = np.zeros((2 * 16 * k,), np.int8)
    st = np.zeros((2 * 16 * ng,), np.float32)
    lib.q8_quantize(m, k, q8.GROUP, x.ctypes.data, k, xt.ctypes.data, st.ctypes.data, 1)
    rows = xt.reshape(2, ng, 16, q8.GROUP).transpose(0, 2, 1, 3).reshape(32, k)[:m]
    assert np.array_equal(rows, q)
    assert np.array_equal(st.reshape(2, ng, 16).transpose(0, 2, 1).reshape(32, ng)[:m], s)


@needs_kernel
@pytest.mark.parametrize("k", [576, 160, 48])
def test_weights_quantized_in_the_kernel_as_in_numpy(k: int) -> None:
    """A first start packs every weight through quantize_groups (in C where it runs): the
    same int8 and scales as numpy's, NaN, infinity and all-zero groups included."""
    w = _rand((37, k), 9, 0.05)
    w[1, :32] = 0.0
    w[4, 7] = np.inf
    w[6, 40] = np.nan
    q, s = q8.quantize_groups(w)
    ref_q, ref_s = q8.quantize_groups_numpy(w)
    assert q.dtype == np.int8 and np.array_equal(q, ref_q)
    assert np.array_equal(s, ref_s, equal_nan=True) and np.isnan(s[4, 0]) and s[1, 0] == 1


def _numpy_packed(w: np.ndarray) -> q8.Q8Weights:
    """Q8Weights.pack's numpy path (where the kernel does not run), as the reference."""
    real = q8.library
    q8.library = lambda: None  # type: ignore[assignment]
    try:
        return q8.Q8Weights.pack(w)
    finally:
        q8.library = real  # type: ignore[assignment]


@needs_kernel
@pytest.mark.parametrize("kind", ["float32", "bf16", "float16"])
@pytest.mark.parametrize(("n", "k"), [(16, 16), (48, 48), (64, 576), (32, 160)])
def test_a_table_packs_in_one_pass_as_numpy_packs_it(kind: str, n: int, k: int) -> None:
    """A first start packs each weight table through q8_pack, read as it lies (bf16 bits,
    float16, float32) and split over threads: the very bytes numpy's passes make from its
    float32, NaN, infinity and all-zero groups included."""
    w = _rand((n, k), 21, 0.05)
    w[1, :16] = 0.0
    w[2, 3] = np.nan
    w[5, k - 1] = -np.inf
    table = {"float32": w, "bf16": bf16_bits(w), "float16": w.astype(np.float16)}[kind]
    ref = _numpy_packed(table)
    for threads in (1, 2):
        got = q8.Q8Weights.pack(table, threads=threads)
        assert np.array_equal(got.packed, ref.packed) and np.array_equal(got.offsets, ref.offsets)
        assert np.array_equal(got.scales, ref.scales, equal_nan=True)
    assert np.isnan(ref.scales).sum() == 2  # (the test sees the NaN groups)


@needs_kernel
def test_a_layers_parts_pack_as_their_concatenation() -> None:
    """q, k and v (gate and up) packed part by part into one buffer, as the layer's joined
    table would be, into bytes the caller gives (an MLX array's)."""
    parts = [bf16_bits(_rand((n, 96), 30 + n, 0.1)) for n in (64, 32, 32)]
    joined = _numpy_packed(np.concatenate(parts))
    into = np.zeros(q8.Q8Weights.nbytes(128, 96), np.uint8)
    got = q8.Q8Weights.pack(parts, threads=2, into=into)
    assert got.buffer.ctypes.data == into.ctypes.data
    assert np.array_equal(into, joined.buffer)


@needs_kernel
def test_a_row_is_the_same_alone_in_any_batch_at_any_place_and_split(split_all) -> None:
    k, n = 576, 960
    w = q8.Q8Weights.pack(_rand((n, k), 5, 0.05))
    rows = _rand((70, k), 6)
    alone = np.stack([_run(rows[i : i + 1], w)[0] for i in range(len(rows))])
    # VNNI's row blocks of 6 and their tails; from AMX_ROWS AMX's tiles of 16 where it runs
    for m in (2, 5, 6, 7, 13, 16, 17, 33, 64, 70):
        for threads in (1, 2, 4):
            got = _run(rows[:m], w, threads)
            assert np.array_equal(got, alone[:m]), (m, threads)
    shuffled = np.random.default_rng(7).permutation(70)
    got = _run(rows[shuffled], w, 2)
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


@needs_amx
def test_the_library_self_test_finds_amx_and_vnni_alike() -> None:
    assert AMX_PROBE == 0, "q8_amx_selftest: AMX and VNNI gave different bits"


@needs_amx
@pytest.mark.parametrize(("n", "k"), [(16, 32), (80, 96), (960, 576), (48, 2048)])
def test_amx_and_vnni_give_the_same_bits(n: int, k: int, monkeypatch, split_all) -> None:
    # the same integer sums and the same float epilogue: a request's answer does not depend on
    # the CPU it runs on (AMX or not) nor on which path its batch width takes
    assert q8.library().q8_amx_init() == 0
    monkeypatch.setattr(q8, "amx", lambda: True)  # even where the self-test failed
    w = q8.Q8Weights.pack(_rand((n, k), 12, 0.05))
    rows = _rand((70, k), 13)
    rows[9, k // 2] = np.inf  # a row with a non-finite input: NaN on both paths, alike
    for m in (1, 3, 15, 16, 17, 31, 32, 33, 48, 70):  # full and short tiles, 2 x 2 blocks
        vnni = _run(rows[:m], w, amx=False)
        for threads in (1, 2):
            amx = _run(rows[:m], w, threads, amx=True)
            assert np.array_equal(amx.view(np.uint32), vnni.view(np.uint32)), (m, threads)
    assert np.isnan(vnni[9]).all()


@pytest.mark.skipif(not (q8.available() and cpu_has(q8.AMX_FLAGS)), reason="no AMX advertised here")
def test_the_amx_verdict_is_probed_once_and_kept(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("BATCHMLX_CACHE_DIR", str(tmp_path))
    q8.amx.cache_clear()
    try:
        first = q8.amx()
        mark = q8._amx_mark()
        assert mark is not None and mark.read_text() == ("yes" if first else "no")
        mark.write_text("no")  # a CPU that traps AMX: believed without probing again
        q8.amx.cache_clear()
        assert q8.amx() is False
        x, w = _rand((32, 64), 14), q8.Q8Weights.pack(_rand((32, 64), 15))
        assert np.array_equal(_run(x, w), _run(x, w, amx=False))  # auto: VNNI
        with pytest.raises(RuntimeError, match="AMX"):
            _run(x, w, amx=True)
    finally:
        q8.amx.cache_clear()


@needs_kernel
@pytest.mark.parametrize("amx", [False, pytest.param(True, marks=needs_amx)])
def test_the_pool_gives_one_threads_bits_for_any_shape_and_rows(amx: bool, split_all) -> None:
    # random shapes and 1..300 rows, each product repeated: q8.c's pool workers take columns
    # in chunks from a shared counter, which changes who computes a column, never its bits
    rng = np.random.default_rng(16)
    helped = q8.pool_workers()[1]
    for case in range(12):
        n = 16 * int(rng.integers(1, 100))
        k = (32 if amx else 16) * int(rng.integers(1, 50))
        m = int(rng.integers(1, 301)) if case else 1
        w = q8.Q8Weights.pack(_rand((n, k), 100 + case, 0.05))
        x = _rand((m, k), 200 + case)
        one = _run(x, w, 1, amx=amx)
        for threads in (2, 3, 2, 4):
            got = _run(x, w, threads, amx=amx)
            assert np.array_equal(got.view(np.uint32), one.view(np.uint32)), (n, k, m, threads)
    workers, now = q8.pool_workers()
    assert workers >= 3 and now > helped  # the pool's threads took part


@needs_kernel
def test_the_pool_serves_calls_from_several_threads_at_once(split_all) -> None:
    # one caller at a time uses the pool, the others compute alone: the same bits either way
    from concurrent.futures import ThreadPoolExecutor

    w = q8.Q8Weights.pack(_rand((1024, 576), 17, 0.05))
    xs = [_rand((m, 576), 300 + m) for m in (1, 5, 17, 64)]
    want = [_run(x, w) for x in xs]
    with ThreadPoolExecutor(4) as callers:
        for _ in range(20):
            got = list(callers.map(lambda x: _run(x, w, 2), xs))
            assert all(np.array_equal(g, e) for g, e in zip(got, want, strict=True))


_FORKED = """
import os, warnings, numpy as np
from batchmlx.engine.host import q8
warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: what is tested
q8.SPLIT_MACS = 0
rng = np.random.default_rng(0)
w = q8.Q8Weights.pack((rng.standard_normal((960, 576)) * 0.05).astype(np.float32))
x = rng.standard_normal((64, 576)).astype(np.float32)
y, again = np.empty((64, 960), np.float32), np.empty((64, 960), np.float32)
q8.matmul(x, w, y, threads=2)
pid = os.fork()
if pid == 0:
    import time
    helped, same, calls = q8.pool_workers()[1], True, 0
    # until a worker has taken a part (at once on an idle machine; a loaded one may hold the
    # new threads back for many calls), 20 s at most
    deadline = time.monotonic() + 20
    while calls < 200 or q8.pool_workers()[1] <= helped and time.monotonic() < deadline:
        q8.matmul(x, w, again, threads=2)
        same, calls = same and np.array_equal(y, again), calls + 1
    os._exit(0 if same and q8.pool_workers()[1] > helped else 1)
os._exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


@needs_kernel
def test_a_forked_child_starts_a_pool_of_its_own() -> None:
    # the parent's workers do not exist in a child: it starts its own, which take part (run
    # in a child of ours: pytest's process has threads)
    done = subprocess.run([sys.executable, "-c", _FORKED], capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr.decode()


def _experts_case(rng: np.random.Generator, case: int, step: int):
    """Random experts' weights (one shape), a random subset of them in random order, and each
    one's rows: none, one, odd counts, a few past a tile of 16."""
    e = int(rng.integers(1, 10))
    n, k = 16 * int(rng.integers(1, 60)), step * int(rng.integers(1, 30))
    ws = [q8.Q8Weights.pack(_rand((n, k), 400 + 10 * case + i, 0.05)) for i in range(e)]
    ids = rng.permutation(e)[: int(rng.integers(1, e + 1))].astype(np.int32)
    counts = rng.choice([0, 1, 2, 3, 4, 5, 7, 9, 16, 17, 33], len(ids))
    if case == 0:
        counts[:] = 0  # every expert listed, no rows at all
    bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    return ws, ids, bounds, _rand((int(bounds[-1]), k), 500 + case)


@needs_kernel
@pytest.mark.parametrize("amx", [False, pytest.param(True, marks=needs_amx)])
def test_experts_in_one_call_give_each_rows_bits_alone(amx: bool, monkeypatch, split_all) -> None:
    # q8_experts: each expert's run of rows through its own weights, (expert, column chunk)
    # pieces over the pool; every row's bits those of q8.matmul on that row alone (VNNI), with
    # AMX (from AMX_ROWS rows) or not, whatever the other experts and their rows
    assert not amx or q8.library().q8_amx_init() == 0  # this thread's AMX state, as amx() asks
    monkeypatch.setattr(q8, "amx", lambda: amx)
    rng = np.random.default_rng(18)
    helped = q8.pool_workers()[1]
    for case in range(10):
        ws, ids, bounds, x = _experts_case(rng, case, 32 if amx else 16)
        table = q8.Q8Experts(tuple(ws))
        alone = np.full((len(x), ws[0].n), np.nan, np.float32)
        for a, e in enumerate(ids):
            for r in range(bounds[a], bounds[a + 1]):
                alone[r] = _run(x[r : r + 1], ws[e], amx=False)[0]
        # rows read through a wider array too (the host step's slabs)
        wide = np.zeros((len(x), x.shape[1] + 32), np.float32)
        wide[:, 16:-16] = x
        for rows, threads in ((x, 1), (x, 2), (wide[:, 16:-16], 3)):
            got = np.full_like(alone, np.nan)
            q8.matmul_experts(rows, ids, bounds, table, got, threads=threads)
            assert np.array_equal(got.view(np.uint32), alone.view(np.uint32)), (case, threads)
    assert q8.pool_workers()[1] > helped  # the pool's threads took part


@needs_kernel
def test_experts_in_one_call_check_what_they_are_given() -> None:
    ws = [q8.Q8Weights.pack(_rand((32, 64), 19 + i)) for i in range(2)]
    table = q8.Q8Experts(tuple(ws))
    x, out = _rand((3, 64), 21), np.full((3, 32), np.nan, np.float32)
    q8.matmul_experts(x, np.zeros(0, np.int32), np.zeros(1, np.int32), table, out)
    assert np.isnan(out).all()  # no experts: nothing written
    with pytest.raises(ValueError, match="bounds"):
        q8.matmul_experts(x, np.array([0, 1], np.int32), np.array([0, 3], np.int32), table, out)
    # refused before anything is written: an expert past E, bounds not ascending from 0 to at
    # most M (q8.c checks them: a wrong one would read and write past the buffers)
    ids = np.array([0, 1], np.int32)
    for bad_ids, bounds in ((np.array([0, 2], np.int32), [0, 1, 3]), (ids, [0, 2, 1]),
                            (ids, [1, 2, 3]), (ids, [0, 1, 4])):  # fmt: skip
        with pytest.raises(ValueError, match="for 3 rows"):
            q8.matmul_experts(x, bad_ids, np.array(bounds, np.int32), table, out)
        assert np.isnan(out).all()
    with pytest.raises(ValueError, match="out"):
        q8.matmul_experts(x, ids, np.array([0, 1, 3], np.int32), table, out[:, :16])
    q8.matmul_experts(x, ids, np.array([0, 1, 3], np.int32), table, out)
    assert np.array_equal(out[:1], _run(x[:1], ws[0]))
    assert np.array_equal(out[1:], _run(x[1:], ws[1]))
    with pytest.raises(ValueError, match="shapes"):
        q8.Q8Experts((ws[0], q8.Q8Weights.pack(_rand((48, 64), 22))))
    assert q8.expert_runs([ws[0], None], [ws[1], ws[1]], lambda: 1) is None
    assert q8.expert_runs(ws, ws, lambda: 1) is not None
