"""Fast elementwise kernels equal MLX's own; a step swaps mlx-lm's swiglu only while it runs."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from batchmlx.engine.kernels.elementwise import (
    ShapeCompiled,
    exp_shifted,
    fast_swiglu,
    is_mlx_lm_swiglu,
)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_fast_swiglu_equals_mlx_lm_swiglu(dtype) -> None:
    from mlx_lm.models.activations import swiglu

    keys = mx.random.split(mx.random.key(5), 2)
    gate = (mx.random.normal((3, 7, 96), key=keys[0]) * 6).astype(dtype)
    x = mx.random.normal((3, 7, 96), key=keys[1]).astype(dtype)
    extremes = mx.broadcast_to(mx.array([[[-200.0, 200.0, 0.0] * 32]], dtype), (3, 1, 96))
    gate = mx.concatenate([gate, extremes], axis=1)
    x = mx.concatenate([x, mx.ones((3, 1, 96), dtype)], axis=1)
    got, want = fast_swiglu(gate, x), swiglu(gate, x)
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = 1e-6 if dtype == mx.float32 else 1e-2
    np.testing.assert_allclose(
        np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)), rtol=tol, atol=tol
    )
    assert is_mlx_lm_swiglu(swiglu) and not is_mlx_lm_swiglu(fast_swiglu)


def test_exp_shifted_is_softmax_numerators() -> None:
    s = mx.random.normal((4, 33), key=mx.random.key(2)) * 10
    m = s.max(axis=-1, keepdims=True)
    np.testing.assert_allclose(np.array(exp_shifted(s, m)), np.exp(np.array(s - m)), rtol=2e-6)


def test_shape_compiled_keeps_at_most_its_limit_of_shapes() -> None:
    f = ShapeCompiled(lambda a: a * 2 + 1, limit=2)
    for n in (1, 2, 3, 2, 4):
        np.testing.assert_array_equal(np.array(f(mx.ones((n,)))), np.full(n, 3.0))
        assert len(f._shapes) <= 2
    assert f._shapes == {(((4,), mx.float32),)}  # restarted at shape 3, then at shape 4


def test_the_step_swaps_swiglu_and_puts_it_back(tiny_model, monkeypatch) -> None:
    import sys

    from batchmlx.engine.kernels import attention
    from batchmlx.engine.kernels.attention import AttentionRoute, step_swiglu

    module = sys.modules[type(tiny_model).__module__]
    original = module.swiglu
    route = AttentionRoute(tiny_model)
    with route.active():
        assert module.swiglu is step_swiglu
    assert module.swiglu is original
    monkeypatch.setattr(attention, "FAST_SWIGLU", False)
    with route.active():
        assert module.swiglu is original


def test_the_cpu_kernels_are_chosen_on_the_cpu_only() -> None:
    from batchmlx.engine.kernels import attention

    assert attention.cpu_kernels(mx.Device(mx.DeviceType.cpu))
    assert not attention.cpu_kernels(mx.Device(mx.DeviceType.gpu))
    assert attention.FAST_ATTENTION == (mx.default_device().type == mx.DeviceType.cpu)


@pytest.mark.parametrize("traditional", [True, False])
@pytest.mark.parametrize("dims", [64, 32])  # 32: partial rotary, the rest passes unchanged
@pytest.mark.parametrize("length", [1, 5])  # a packed step's rows; a padded step's chunks
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_step_rope_is_bit_for_bit_mlx_fast_rope(traditional, dims, length, dtype) -> None:
    from batchmlx.engine.kernels.elementwise import StepRoPE

    rope = nn.RoPE(dims, traditional=traditional, base=100000.0, scale=0.5)
    x = (mx.random.normal((7, 3, length, 64), key=mx.random.key(3)) * 3).astype(dtype)
    offset = mx.array([0, 1, 17, 300, 4095, 8000, 123], dtype=mx.int32)
    tables: dict = {}
    step = StepRoPE(rope, tables)
    got, want = step(x, offset=offset), rope(x, offset=offset)
    assert mx.array_equal(got, want).item()
    assert len(tables) == 1
    step(x * 2, offset=offset)  # another layer of the same step reads the same table
    assert len(tables) == 1
    assert mx.array_equal(step(x, offset=4), rope(x, offset=4)).item()  # plain cache: as is


def test_the_step_swaps_plain_ropes_and_puts_them_back(tiny_model, monkeypatch) -> None:
    from batchmlx.engine.kernels import attention
    from batchmlx.engine.kernels.attention import AttentionRoute
    from batchmlx.engine.kernels.elementwise import StepRoPE

    attns = [layer.self_attn for layer in tiny_model.model.layers]
    originals = [a.rope for a in attns]
    route = AttentionRoute(tiny_model)
    assert len(route.ropes) == len(attns)
    with route.active():
        assert all(isinstance(a.rope, StepRoPE) for a in attns)
    assert all(a.rope is o for a, o in zip(attns, originals, strict=True))
    monkeypatch.setattr(attention, "STEP_ROPE", False)
    with route.active():
        assert all(a.rope is o for a, o in zip(attns, originals, strict=True))
