"""The embedder's prefix cache on a tiny random model: reused blocks change no vector."""

from __future__ import annotations

import numpy as np

from batchmlx.engine.embed import Embedder

SHARED = [5, 9, 17, 33, 65, 129, 3, 7, 11, 13]  # 10 tokens: two full blocks of 4, and 2 more


def _inputs():
    return [SHARED + [20, 21, 22], SHARED + [40], [1, 2, 3], SHARED[:8], SHARED + list(range(30))]


def test_cached_prefix_blocks_give_the_same_vectors(tiny_model):
    fresh = Embedder(tiny_model, block_size=4, max_blocks=0).embed(_inputs())
    cached = Embedder(tiny_model, block_size=4)
    first = cached.embed(_inputs())
    assert cached.stats.reused_tokens == 0
    computed = cached.stats.computed_tokens
    again = cached.embed(_inputs()[::-1])[::-1]  # order in, order out
    assert cached.stats.reused_tokens > 0
    assert cached.stats.computed_tokens - computed < computed  # the second pass ran less
    for a, b, c in zip(fresh, first, again, strict=True):
        assert abs(float(np.linalg.norm(a)) - 1.0) < 1e-5
        np.testing.assert_allclose(b, a, atol=1e-5)
        np.testing.assert_allclose(c, a, atol=1e-4)


def test_new_inputs_hit_blocks_of_earlier_ones(tiny_model):
    emb = Embedder(tiny_model, block_size=4)
    emb.embed([SHARED + [99]])
    before = emb.stats.reused_tokens
    (vec,) = emb.embed([SHARED + [98, 97]])
    assert emb.stats.reused_tokens - before == 8  # both full blocks of the shared prefix
    (plain,) = Embedder(tiny_model, block_size=4, max_blocks=0).embed([SHARED + [98, 97]])
    np.testing.assert_allclose(vec, plain, atol=1e-4)
