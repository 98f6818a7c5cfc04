"""engine/host/quantized.py: MLX's affine-quantized arrays packed and read back in numpy, equal
to MLX's own; and a host format packs an affine layer with float32 scales (a converted GGUF's)
from them, only where the weights cache does not hold the packed layer already."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from batchmlx.engine.host import quantized
from batchmlx.engine.host import weights_cache as host_cache
from batchmlx.engine.host.linear import HostFormat, PackedCache, runs_here, to_host_format
from tests.engine.test_host_cache import TOKENS, _flat, _fresh


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_unpack_and_dequantize_are_mlx_s(bits: int) -> None:
    rng = np.random.default_rng(bits)
    w = mx.array(rng.normal(size=(48, 256)).astype(np.float32))
    q, s, b = mx.quantize(w, group_size=32, bits=bits)
    ones, zeros = mx.ones_like(s), mx.zeros_like(b)
    values = np.array(mx.dequantize(q, ones, zeros, group_size=32, bits=bits)).astype(np.uint8)
    np.testing.assert_array_equal(quantized.unpack(np.array(q), bits), values)
    np.testing.assert_array_equal(quantized.pack(values, bits), np.array(q))
    got = quantized.dequantize(np.array(q), np.array(s), np.array(b), bits, 32)
    np.testing.assert_array_equal(got, np.array(mx.dequantize(q, s, b, group_size=32, bits=bits)))


def _quantized(args, weights):
    model = _fresh(args, weights)
    model.set_dtype(mx.float32)  # float32 scales, as a converted GGUF's
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def test_a_quantized_layer_is_dequantized_once_when_packed_never_from_the_cache(
    tiny_model, tmp_path, monkeypatch
) -> None:
    fmt = next((f for f in (HostFormat.BF16, HostFormat.INT8) if runs_here(f)), None)
    if fmt is None:
        pytest.skip("no packed format on this CPU")
    weights = [(k, mx.array(v)) for k, v in _flat(tiny_model)]
    calls = []
    real = quantized.dequantize
    monkeypatch.setattr(quantized, "dequantize",
                        lambda *a, **k: calls.append(a[3]) or real(*a, **k))  # fmt: skip
    model = _quantized(tiny_model.args, weights)
    layers = sum(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                 for _, m in model.named_modules())  # fmt: skip
    reference = _quantized(tiny_model.args, weights)
    first = PackedCache()
    to_host_format(model, fmt, first)
    assert len(calls) == layers and set(calls) == {4}
    # the same as MLX's own dequantization packed
    for _, m in reference.named_modules():
        for name, child in m.children().items():
            if isinstance(child, nn.QuantizedLinear):
                dense = nn.Linear(1, 1, bias=False)
                dense.weight = mx.dequantize(child.weight, child.scales, child.biases,
                                             group_size=32, bits=4)  # fmt: skip
                setattr(m, name, dense)
            elif isinstance(child, nn.QuantizedEmbedding):
                dense_e = nn.Embedding(1, 1)
                dense_e.weight = mx.dequantize(child.weight, child.scales, child.biases,
                                               group_size=32, bits=4)  # fmt: skip
                setattr(m, name, dense_e)
    to_host_format(reference, fmt)
    want = np.array(model(TOKENS))
    np.testing.assert_array_equal(np.array(reference(TOKENS)), want)
    path = tmp_path / "m.safetensors"
    assert host_cache.save_cache(path, first, "sig")
    calls.clear()
    again = _quantized(tiny_model.args, weights)
    to_host_format(again, fmt, host_cache.open_cache(path, "sig"))
    assert calls == []
    np.testing.assert_array_equal(np.array(again(TOKENS)), want)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_a_layers_tables_join_as_mlx_joins_them(dtype) -> None:
    """stored.joined (numpy over the stored bits, for a first start's speed): the very array
    mx.concatenate gives, in its dtype; tables of two dtypes take MLX's own way."""
    from batchmlx.engine.host import stored

    rng = np.random.default_rng(3)
    parts = [
        mx.array(rng.normal(size=(n, 64)).astype(np.float32)).astype(dtype) for n in (32, 8, 8)
    ]
    got, want = stored.joined(parts), mx.concatenate(parts, axis=0)
    assert got.dtype == want.dtype and mx.array_equal(got, want).item()
    mixed = [parts[0], parts[1].astype(mx.float32)]
    assert mx.array_equal(stored.joined(mixed), mx.concatenate(mixed, axis=0)).item()
    assert stored.joined(parts[:1]) is parts[0]
