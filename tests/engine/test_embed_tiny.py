"""The embedder's prefix cache on a tiny random model: reused blocks change no vector."""

from __future__ import annotations

import numpy as np
import pytest

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


def test_slices_bound_each_pass_and_change_no_vector(tiny_model):
    """A budget of 8 tokens: every forward pass runs at most 8 new tokens (a 40-token input in
    five chunks on top of its own keys and values), and the vectors are those of one pass."""
    inputs = [list(range(1, 41)), [3, 4, 5], [7, 8, 9, 10, 11], list(range(50, 70))]
    whole = Embedder(tiny_model, block_size=4, max_blocks=0).embed(inputs)
    emb = Embedder(tiny_model, block_size=4)
    passes, got = 0, {}
    before = 0
    for done in emb.slices(inputs, budget=8):
        passes += 1
        assert emb.stats.computed_tokens - before <= 8
        before = emb.stats.computed_tokens
        got.update(done)
    assert sorted(got) == [0, 1, 2, 3]
    assert passes >= (40 + 3 + 5 + 20) // 8
    for i, vec in enumerate(whole):
        np.testing.assert_allclose(got[i], vec, atol=1e-4)
    # the chunked long input left its blocks for the next request sharing its prefix
    (again,) = emb.embed([list(range(1, 41))])
    assert emb.stats.reused_tokens >= 36
    np.testing.assert_allclose(again, whole[0], atol=1e-4)


def test_token_ids_outside_the_table_are_refused_not_read(tiny_model):
    """MLX does not check a gather's indices: past the table is a segfault, so the embedder
    refuses such ids before any pass (the worker answers them with a 400 before this)."""
    emb = Embedder(tiny_model)
    for bad in (256, 1_000_000, -1):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            emb.embed([[1, 2], [bad]])
