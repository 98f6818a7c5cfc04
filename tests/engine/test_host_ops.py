"""The host step's elementwise kernel (engine/host/ops.py, native/ops.c) against the numpy forms
it replaces: close to them, each row's result the same whatever the batch, and a host step
with the kernel as near to one without it as to the MLX path."""

from __future__ import annotations

import numpy as np
import pytest

from batchmlx.engine.host import elementwise, ops, q8
from batchmlx.engine.host.step import HostNorm, _rms_norm
from tests.engine.test_decode_kv import churn
from tests.engine.test_engine_tiny import engine, staggered
from tests.engine.test_host_step import ANY, TOLERANCE, _tokens, tiny

pytestmark = pytest.mark.skipif(not ops.available(), reason="the host ops kernel (AVX-512F)")

# silu's and gelu's extremes: exp over- and underflow, a zero, NaN and infinities
SPECIAL = np.array([-1e4, -100.0, -88.5, -30.0, -1e-6, 0.0, 1e-6, 15.0, 88.5, 100.0, 1e4,
                    np.nan, np.inf, -np.inf], np.float32)  # fmt: skip


def _gate_up(m: int, i: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    gu = (rng.standard_normal((m, 2 * i)) * 4).astype(np.float32)
    gu[0, : SPECIAL.size] = SPECIAL
    gu[0, i : i + SPECIAL.size] = 1.5  # their up halves finite
    return gu


def _numpy(gu: np.ndarray, act: ops.Activation) -> np.ndarray:
    tile = elementwise._swiglu_tile if act is ops.Activation.SILU else elementwise._geglu_tile
    i = gu.shape[1] // 2
    out = np.empty((gu.shape[0], i), np.float32)
    with np.errstate(invalid="ignore"):  # -inf's silu and gelu: NaN, as the kernel's
        elementwise._gated_rows(gu, out, i, 0, gu.shape[0], 4, tile)
    return out


@pytest.mark.parametrize("act", list(ops.Activation), ids=lambda a: a.name)
@pytest.mark.parametrize("i", [1536, 40], ids=["vectors", "tail"])
def test_gated_activation_is_numpys_within_float32_rounding(act, i):
    gu = _gate_up(9, i)
    want = _numpy(gu, act)
    got = elementwise._gated_halves(gu, lambda *a: None, act, None, None)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    # the exponential is our own (~2 ulp); gelu's 1 + tanh is computed without cancellation
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6 * np.nanmax(np.abs(want[1:])))
    assert got[0, 0] == 0 and got[0, 9] == pytest.approx(want[0, 9])  # -1e4: 0, not NaN


def test_gated_activation_of_a_row_is_the_same_in_any_batch_and_split():
    gu = _gate_up(700, 768, seed=1)  # 700 x 768: split over two threads where it has them
    whole = elementwise.swiglu_halves(gu)
    alone = np.concatenate([elementwise.swiglu_halves(gu[r : r + 1]) for r in (0, 350, 699)])
    np.testing.assert_array_equal(alone, whole[[0, 350, 699]])
    wide = np.zeros((700, 3 * 768), np.float32)  # rows further apart: a view, not a copy
    wide[:, : 2 * 768] = gu
    out = np.zeros((700, 800), np.float32)[:, :768]
    elementwise._gated_halves(wide[:, : 2 * 768], lambda *a: None, ops.Activation.SILU, out,
                              None)  # fmt: skip
    np.testing.assert_array_equal(out, whole)


def test_the_numpy_form_where_the_kernel_does_not_run(monkeypatch):
    gu = _gate_up(5, 64)
    gu[0, : SPECIAL.size] = np.nan_to_num(SPECIAL, nan=0.0, posinf=50.0, neginf=-50.0)
    monkeypatch.setattr(ops, "available", lambda: False)
    np.testing.assert_array_equal(elementwise.swiglu_halves(gu), _numpy(gu, ops.Activation.SILU))
    np.testing.assert_array_equal(elementwise.geglu_halves(gu),
                                  _numpy(gu, ops.Activation.GELU_TANH))  # fmt: skip


@pytest.mark.parametrize("n", [576, 40])
def test_rms_norm_and_the_residual_add_before_it(n):
    rng = np.random.default_rng(2)
    w = rng.standard_normal(n).astype(np.float32)
    norm = HostNorm(w, np.float32(1e-5), w.ctypes.data)
    x = (rng.standard_normal((6, n)) * 3).astype(np.float32)
    x[5] = 0  # eps alone under the root
    r = rng.standard_normal((6, n)).astype(np.float32)
    want_x = x + r
    want = _rms_norm(want_x, w, np.float32(1e-5))
    np.testing.assert_allclose(norm(want_x), want, rtol=1e-6, atol=1e-6)
    got = norm.add_then(x, r)
    np.testing.assert_array_equal(x, want_x)  # the add: one float32 sum, as numpy's
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # each row alone as in the batch, bit for bit
    for row in (0, 3):
        np.testing.assert_array_equal(norm(want_x[row : row + 1])[0], got[row])
    # heads [T, H, D] (q and k norms) are not rows: the numpy form
    heads = want_x[:, : (n // 8) * 8].reshape(6, 8, -1)
    small = HostNorm(w[: heads.shape[2]].copy(), np.float32(1e-5), 0)
    np.testing.assert_array_equal(small(heads), _rms_norm(heads, small.weight, small.eps))


def test_a_host_step_with_the_kernel_is_near_the_numpy_forms(monkeypatch):
    """The same steps with and without the kernel: as close as either is to the MLX path
    (test_host_step's bound), the same greedy tokens."""
    model = tiny(ANY)
    work = churn()
    diffs: list[float] = []
    e = engine(model, max_batch_size=8, max_prefill_tokens=24, block_size=8)
    forward = e.runner.forward_pass.forward
    real = ops.available()

    def both(layout, rows):
        monkeypatch.setattr(ops, "available", lambda: False)
        want = np.array(forward(layout, rows))  # writes the same KV rows the second rewrites
        monkeypatch.setattr(ops, "available", lambda: real)
        got = forward(layout, rows)
        diffs.append(float(np.abs(np.array(got) - want).max() / np.abs(want).max()))
        return got

    e.runner.forward_pass.forward = both
    outs = staggered(e, work)
    assert len(diffs) >= 20 and max(diffs) < TOLERANCE[ANY], max(diffs)
    monkeypatch.setattr(ops, "available", lambda: False)
    ref = engine(model, max_batch_size=8, max_prefill_tokens=24, block_size=8)
    assert _tokens(outs) == _tokens(staggered(ref, work))


@pytest.mark.skipif(q8.pool_runner() is None, reason="q8's pool does not run on this CPU")
@pytest.mark.parametrize("threads", [2, 3])
def test_the_passes_by_rows_on_the_gemm_workers_give_one_threads_bits(threads):
    """gated, the norm (with its residual add) and RoPE handed to q8's workers by rows (ops.c's
    *_pooled) give the bits of one thread's pass over every row, odd row counts included; and
    the workers took rows (their help counter moved)."""
    lib, runner = ops.library(), q8.pool_runner()
    rng = np.random.default_rng(5)
    helped = q8.pool_workers()[1]
    for m in (37, 300):
        gu = _gate_up(m, 1536, seed=m)
        one, pooled = np.empty((m, 1536), np.float32), np.empty((m, 1536), np.float32)
        lib.ops_gated(0, m, 1536, gu.ctypes.data, 3072, one.ctypes.data, 1536, 0)
        lib.ops_gated_pooled(m, 1536, gu.ctypes.data, 3072, pooled.ctypes.data, 1536, 0, runner,
                             threads)  # fmt: skip
        np.testing.assert_array_equal(pooled, one)

        w = rng.standard_normal(576).astype(np.float32)
        x = rng.standard_normal((m, 576)).astype(np.float32)
        r = rng.standard_normal((m, 576)).astype(np.float32)
        x1, x2 = x.copy(), x.copy()
        o1, o2 = np.empty_like(x), np.empty_like(x)
        lib.ops_rms_norm(m, 576, x1.ctypes.data, 576, r.ctypes.data, 576, w.ctypes.data,
                         1e-5, o1.ctypes.data, 576)  # fmt: skip
        lib.ops_rms_norm_pooled(m, 576, x2.ctypes.data, 576, r.ctypes.data, 576, w.ctypes.data,
                                1e-5, o2.ctypes.data, 576, runner, threads)  # fmt: skip
        np.testing.assert_array_equal(x2, x1)
        np.testing.assert_array_equal(o2, o1)

        h, d = 12, 64
        q = rng.standard_normal((m, h * d)).astype(np.float32)
        cos = rng.standard_normal((m, d // 2)).astype(np.float32)
        sin = rng.standard_normal((m, d // 2)).astype(np.float32)
        r1, r2 = np.empty((m, h, d), np.float32), np.empty((m, h, d), np.float32)
        args = (m, h, d, d, 0, q.ctypes.data, h * d, cos.ctypes.data, sin.ctypes.data)
        lib.ops_rope(*args, r1.ctypes.data, 9, 0.125)
        lib.ops_rope_pooled(*args, r2.ctypes.data, 9, 0.125, runner, threads)
        np.testing.assert_array_equal(r2, r1)
    # a sleeping worker wakes later than these short passes end: it helps once it spins
    gu = _gate_up(300, 1536)
    out = np.empty((300, 1536), np.float32)
    for _ in range(200):
        lib.ops_gated_pooled(300, 1536, gu.ctypes.data, 3072, out.ctypes.data, 1536, 0, runner,
                             threads)  # fmt: skip
        if q8.pool_workers()[1] > helped:
            break
    assert q8.pool_workers()[1] > helped
