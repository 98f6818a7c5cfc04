"""Cascade attention (shared prefix once + per-sequence suffix) equals plain attention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from batchmlx.engine.kernels.attention import cascade_attention
from batchmlx.engine.kv.paged import BatchLayout


@pytest.mark.parametrize(("q_len", "rep"), [(1, 3), (4, 1), (3, 2)])
def test_cascade_equals_attention_over_concatenated_keys(q_len: int, rep: int) -> None:
    mx.random.seed(3)
    b, h, d, kp, ks = 4, 2, 16, 32, 9
    q = mx.random.normal((b, h * rep, q_len, d))
    prefix_k, prefix_v = mx.random.normal((h, kp, d)), mx.random.normal((h, kp, d))
    suf_k, suf_v = mx.random.normal((b, h, ks, d)), mx.random.normal((b, h, ks, d))
    # ragged suffixes: sequence i sees its first ks - i suffix keys, causally for its queries
    valid = np.arange(ks)[None, :] < (ks - np.arange(b))[:, None]
    qpos = (ks - np.arange(b))[:, None] - q_len + np.arange(q_len)[None, :]
    mask = (np.arange(ks)[None, None, :] <= qpos[:, :, None]) & valid[:, None, :]
    mask = mx.array(mask[:, None])

    full_k = mx.concatenate([mx.broadcast_to(prefix_k[None], (b, h, kp, d)), suf_k], axis=2)
    full_v = mx.concatenate([mx.broadcast_to(prefix_v[None], (b, h, kp, d)), suf_v], axis=2)
    full_mask = mx.concatenate([mx.ones((b, 1, q_len, kp), dtype=mx.bool_), mask], axis=3)
    want = mx.fast.scaled_dot_product_attention(q, full_k, full_v, scale=0.25, mask=full_mask)
    got = cascade_attention(q, suf_k, suf_v, (prefix_k, prefix_v), 0.25, mask)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)
    # in query tiles, with the keys no query of a tile sees skipped (offset: last row's start)
    tiled = cascade_attention(
        q, suf_k, suf_v, (prefix_k, prefix_v), 0.25, mask, causal_offset=ks - q_len
    )
    np.testing.assert_allclose(np.array(tiled), np.array(want), atol=1e-5, rtol=1e-5)


def test_layout_finds_the_prefix_every_sequence_shares(monkeypatch) -> None:
    from batchmlx.engine.kv import paged as kv_cache

    # blocks of 4; sequences share blocks 1 and 2, then diverge; all computed up to position 10
    tables = [[1, 2, 3], [1, 2, 4], [1, 2, 5]]

    def build():
        return BatchLayout.build(
            block_size=4, n_kv_heads=2, token_chunks=[[7], [8], [9]], starts=[10, 10, 11],
            block_tables=tables,
        )  # fmt: skip

    monkeypatch.setattr(kv_cache, "MIN_CASCADE_BLOCKS", 3)  # two shared blocks: too short
    assert build().prefix_runs is None
    monkeypatch.setattr(kv_cache, "MIN_CASCADE_BLOCKS", 2)
    lay = build()
    assert lay.prefix_runs is not None
    assert np.array(lay.prefix_runs).tolist() == [[2, 4], [3, 5]]  # (block * H + head)
    assert lay.mask.shape == (3, 1, 1, 4)  # only the third block is per sequence
    alone = BatchLayout.build(
        block_size=4, n_kv_heads=2, token_chunks=[[7]], starts=[10], block_tables=[[1, 2, 3]]
    )
    assert alone.prefix_runs is None


def test_paged_attention_is_in_place_only_during_a_step(monkeypatch) -> None:
    import sys
    import types

    from batchmlx.engine.kernels import attention
    from batchmlx.engine.kernels.attention import AttentionRoute
    from batchmlx.engine.kv.paged import PagedLayerCache

    module = types.ModuleType("fake_mlx_lm_arch")
    calls: list[str] = []

    def original(queries, keys, values, cache, scale, mask, sinks=None):
        calls.append("original")
        return queries

    module.scaled_dot_product_attention = original
    model_type = type("Model", (), {"__module__": module.__name__})
    monkeypatch.setitem(sys.modules, module.__name__, module)

    def prefix_attention(queries, keys, values, prefix, scale, mask, *, causal_offset=None):
        calls.append("prefix")
        return queries

    def fast(queries, keys, values, scale, mask, *, causal_offset=None):
        calls.append("chunked")
        return queries

    monkeypatch.setattr(attention, "tiled_attention", fast)
    layout = BatchLayout.build(
        block_size=4, n_kv_heads=1, token_chunks=[[1]], starts=[0], block_tables=[[1]]
    )
    route = AttentionRoute(model_type(), prefix_attention)
    shared = PagedLayerCache.__new__(PagedLayerCache)
    shared.prefix, shared.layout = (mx.zeros(1), mx.zeros(1)), layout
    alone = PagedLayerCache.__new__(PagedLayerCache)
    alone.prefix, alone.layout = None, layout
    with route.active():
        sdpa = module.scaled_dot_product_attention
        assert sdpa is not original
        for cache in (shared, alone, None):
            sdpa(mx.zeros(1), None, None, cache=cache, scale=1.0, mask=layout.mask)
        monkeypatch.setattr(attention, "FAST_ATTENTION", False)  # the old route, for benchmarks
        sdpa(mx.zeros(1), None, None, cache=alone, scale=1.0, mask=layout.mask)
    assert module.scaled_dot_product_attention is original  # put back after the step
    assert calls == ["prefix", "chunked", "original", "original"]
