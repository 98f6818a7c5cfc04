"""What a loaded model and the KV pool hold, and hold once (issue 47: memory accounted for and
cut; `python -m benchmarks.memory` gives the real model's breakdown). Tiny random models."""

from __future__ import annotations

import gc
import mmap

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from batchmlx.engine.host import weights_cache as host_cache
from batchmlx.engine.host.linear import (
    HostEmbedding,
    HostFormat,
    PackedCache,
    SharedGemm,
    runs_here,
    to_host_format,
)
from batchmlx.engine.kv.paged import PagedKVStorage

PACKED = next((f for f in (HostFormat.BF16, HostFormat.INT8) if runs_here(f)), HostFormat.BF16)
packed_here = pytest.mark.skipif(not runs_here(PACKED), reason="no packed format on this CPU")


def _fresh(model: nn.Module) -> nn.Module:
    """A copy of `model` (float weights, before any conversion)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model

    out = Model(model.args)
    out.load_weights([(k, mx.array(np.array(v))) for k, v in tree_flatten(model.parameters())])
    mx.eval(out.parameters())
    return out


def _reachable_arrays(root: object) -> list[tuple[str, object]]:
    """Every MLX or numpy array reachable from `root` through modules, host GEMMs, their
    weights, dicts, lists and tuples (where each was found, the array)."""
    out, seen, stack = [], set(), [("model", root)]
    while stack:
        where, obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, (mx.array, np.ndarray)):
            out.append((where, obj))
        elif isinstance(obj, dict):
            stack += [(f"{where}.{k}", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple)):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, (nn.Module, SharedGemm)) or hasattr(obj, "__dataclass_fields__"):
            fields = dict(getattr(obj, "__dict__", {}))
            for name in getattr(type(obj), "__dataclass_fields__", {}):
                fields[name] = getattr(obj, name, None)
            stack += [(f"{where}.{k}", v) for k, v in fields.items()]
    return out


@packed_here
def test_after_conversion_no_float_copy_of_a_packed_weight_is_referenced(tiny_model):
    """The float weights a layer was packed from are dropped: nothing the model reaches holds a
    2-D float32 array (only 1-D norms stay float32), and MLX's active memory falls by them."""
    model = _fresh(tiny_model)
    gc.collect()
    before = mx.get_active_memory()
    dropped = sum(m.weight.nbytes for _, m in model.named_modules()
                  if isinstance(m, (nn.Linear, nn.Embedding)))  # fmt: skip
    to_host_format(model, PACKED)
    gc.collect()
    arrays = _reachable_arrays(model)
    floats = [(w, a.shape) for w, a in arrays if isinstance(a, mx.array)
              and a.dtype == mx.float32 and a.ndim > 1]  # fmt: skip
    assert floats == []
    owned = {id(a): a.nbytes for _, a in arrays if isinstance(a, mx.array)}
    norms = sum(a.nbytes for _, a in arrays if isinstance(a, mx.array) and a.ndim == 1)
    held_now = mx.get_active_memory() - before + dropped  # what the conversion left held
    # the host arrays and the norms (cast to float32 anew) at most, and no float weight
    assert held_now <= sum(owned.values()) + norms
    assert held_now < sum(owned.values()) + min(
        m._gemm.packed.nbytes for _, m in model.named_modules() if hasattr(m, "_gemm")
    )


@packed_here
def test_the_tied_embedding_read_from_the_cache_is_held_once(tiny_model, tmp_path):
    """Read from the host weights cache, the embedding's lookup rows and the tied head's packed
    weights are both views of the mapped file: no MLX array of the table's size is made, so
    the table is resident once (as the file's pages, as far as they are read)."""
    first = PackedCache()
    to_host_format(_fresh(tiny_model), PACKED, first)
    path = tmp_path / "m.safetensors"
    assert host_cache.save_cache(path, first, "sig")
    model = _fresh(tiny_model)
    vocab, hidden = model.model.embed_tokens.weight.shape
    to_host_format(model, PACKED, host_cache.open_cache(path, "sig"))
    emb = model.model.embed_tokens
    assert isinstance(emb, HostEmbedding) and getattr(model, "lm_head", None) is None  # tied
    for rows in (emb.weight, emb._gemm.packed):
        base = rows
        while isinstance(base, np.ndarray):
            base = base.base
        assert isinstance(base.obj if isinstance(base, memoryview) else base, mmap.mmap)
    table = vocab * hidden
    big = [(w, a.shape) for w, a in _reachable_arrays(model)
           if isinstance(a, mx.array) and a.size >= table]  # fmt: skip
    assert big == []
    np.testing.assert_array_equal(emb.host_rows(), np.asarray(first.kept[
        "model.embed_tokens.plain"].view(mx.uint16)) if PACKED is HostFormat.BF16
        else np.asarray(first.kept["model.embed_tokens.plain"]))  # fmt: skip


def test_a_kv_pool_growth_holds_one_layer_twice_at_most():
    """A growth copies the pool into larger arrays one layer at a time, the old one given back
    before the next: MLX's peak memory over a growth stays under the old pool plus the new one
    (all at once, it held both), and MLX's buffer cache keeps none of the old arrays."""
    layers = 8
    storage = PagedKVStorage(num_layers=layers, n_kv_heads=2, head_dim=64, block_size=16,
                             dtype=mx.float32, max_blocks=4096, grow_blocks=256)  # fmt: skip
    old = storage.nbytes
    mx.clear_cache()
    base = mx.get_active_memory() - old
    mx.reset_peak_memory()
    storage.ensure_capacity(1024)
    new = storage.nbytes
    assert new == 4 * old
    one_layer = new // (2 * layers)
    # the new pool, the old one's last layer and the shared zero padding at most
    assert mx.get_peak_memory() - base <= new + old // (2 * layers) + one_layer
    assert mx.get_cache_memory() < one_layer
