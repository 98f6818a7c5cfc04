"""benchmarks/int8_schemes.py's arithmetic: the simulated grouped and per-channel int8 products
are exactly a float64 reference over the same quantized values (each group's integer sum exact,
then the float32 scaling in the kernel's order), and the quantizer is the engine's."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.int8_schemes import channel_matmul, grouped_matmul, quantize_groups


def _reference(pa: np.ndarray, ta: np.ndarray, qw: np.ndarray, sw: np.ndarray) -> np.ndarray:
    """Each group's integer sum in float64 (exact), then out += (ta * sw) * sum in float32."""
    out = np.zeros((pa.shape[0], qw.shape[2]), np.float32)
    for g in range(pa.shape[1]):
        exact = pa[:, g].astype(np.float64) @ qw[g].astype(np.float64)
        assert np.all(exact == np.rint(exact)) and np.abs(exact).max() < 2**24
        out += exact.astype(np.float32) * (ta[:, g, None] * sw[g][None, :])
    return out


@pytest.mark.parametrize("group", [32, 64, 128])
def test_grouped_product_is_the_float64_reference(group: int) -> None:
    rng = np.random.default_rng(group)
    x = rng.standard_normal((37, 200)).astype(np.float32)  # K not a whole number of groups
    x[:, 3] *= 50.0  # an outlier channel
    w = rng.standard_normal((23, 200)).astype(np.float32)
    pa, ta = quantize_groups(x, group)
    qi, sq = quantize_groups(w, group)
    qw, sw = np.ascontiguousarray(qi.transpose(1, 2, 0)), np.ascontiguousarray(sq.T)
    got = grouped_matmul(pa, ta, qw, sw)
    assert np.array_equal(got, _reference(pa, ta, qw, sw))
    # and it is the product of the dequantized values, to float32 rounding
    deq = (pa * ta[..., None]).reshape(37, -1) @ (qi * sq[..., None]).reshape(23, -1).T
    assert np.allclose(got, deq, rtol=1e-5, atol=1e-4)


def test_extreme_groups_stay_exact() -> None:
    """All +-127 over groups of 128: each sum 128 x 127 x 127, still exact in float32."""
    pa = np.full((3, 2, 128), 127.0, np.float32)
    qw = np.full((2, 128, 5), -127.0, np.float32)
    ta, sw = np.ones((3, 2), np.float32), np.ones((2, 5), np.float32)
    assert np.array_equal(grouped_matmul(pa, ta, qw, sw), np.full((3, 5), -2 * 128 * 127 * 127.0))


def test_channel_product_is_exact_past_float32s_integers() -> None:
    """K = 1,536 of +-127: the int sum (24.8M) is past 2^24, summed exactly, then rounded."""
    rng = np.random.default_rng(1)
    p = rng.choice([-127.0, 127.0], size=(4, 1536)).astype(np.float32)
    p[0] = 127.0
    qt = np.full((1536, 3), 127.0, np.float32)
    t, s = rng.random(4).astype(np.float32), rng.random(3).astype(np.float32)
    exact = p.astype(np.float64) @ qt.astype(np.float64)
    want = exact.astype(np.float32) * s
    want *= t[:, None]
    assert np.array_equal(channel_matmul(p, t, qt, s), want)


def test_one_group_is_the_engines_per_row_quantizer() -> None:
    from batchmlx.engine.host.linear import quantize_rows

    x = np.random.default_rng(2).standard_normal((9, 64)).astype(np.float32)
    x[4] = 0.0
    ints, s = quantize_groups(x, 64)
    q, s_ref = quantize_rows(x)
    assert np.array_equal(ints[:, 0], q.astype(np.float32)) and np.array_equal(s[:, 0], s_ref)
