"""The host SwiGLU equals mlx-lm's; a step sends only prompt-sized float32 ones to the host."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from batchmlx.engine.host import elementwise as host_kernels
from batchmlx.engine.host.elementwise import TILE, host_swiglu
from batchmlx.engine.kernels import attention


def _operands(rows: int, width: int, dtype=mx.float32) -> tuple[mx.array, mx.array]:
    keys = mx.random.split(mx.random.key(rows), 2)
    gate = mx.random.normal((rows, 1, width), key=keys[0]) * 6
    x = mx.random.normal((rows, 1, width), key=keys[1])
    # silu's limits: -200 gives exp overflow on the host (g / inf = -0), 200 gives g itself
    gate[0, 0, :3] = mx.array([-200.0, 200.0, 0.0])
    return gate.astype(dtype), x.astype(dtype)


@pytest.mark.parametrize("rows", [3, 2 * TILE // 96 + 5])  # one thread; two, uneven halves
def test_host_swiglu_equals_mlx_lm_swiglu(rows) -> None:
    from mlx_lm.models.activations import swiglu

    gate, x = _operands(rows, 96)
    before = np.array(gate)
    got, want = host_swiglu(gate, x), swiglu(gate, x)
    assert got.dtype == mx.float32 and got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(np.array(gate), before)  # the operands are left as they were


def test_a_step_sends_only_large_float32_swiglus_to_the_host(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(attention, "HOST_SWIGLU", True)
    monkeypatch.setattr(attention, "host_swiglu", lambda g, x: calls.append(g.shape) or g * x)
    rows = host_kernels.MIN_HOST_ELEMENTS // 64
    big, x = _operands(rows, 64)
    attention.step_swiglu(big, x)
    assert calls == [(rows, 1, 64)]
    small, xs = _operands(rows // 2, 64)  # a decode step's size: MLX's fused kernel
    attention.step_swiglu(small, xs)
    half, xh = _operands(rows, 64, mx.bfloat16)  # numpy has no bfloat16
    attention.step_swiglu(half, xh)
    monkeypatch.setattr(attention, "HOST_SWIGLU", False)
    attention.step_swiglu(big, x)
    assert calls == [(rows, 1, 64)]
