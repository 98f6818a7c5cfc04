"""The prefill/MFU benchmark's FLOP counts and its timers, on the tiny random model."""

from __future__ import annotations

from types import SimpleNamespace

from benchmarks import prefill_mfu as pm


def test_flop_counts_of_the_tiny_llama(tiny_model) -> None:
    mf = pm.ModelFlops.of(tiny_model)
    # per layer: q 64x64, k and v 64x32, o 64x64, gate/up/down 64x128 each
    assert mf.body_params == 2 * (64 * 64 * 2 + 64 * 32 * 2 + 64 * 128 * 3)
    assert mf.head_params == 256 * 64  # tied embeddings
    assert (mf.layers, mf.q_heads, mf.head_dim) == (2, 4, 16)
    assert mf.tokens(3, 1) == 2.0 * (3 * mf.body_params + mf.head_params)
    # a 5-token prompt, 3 tokens generated: decode feeds 2 tokens at positions 5 and 6
    assert pm.decode_flops(mf, [[1] * 5], [[7, 8, 9]]) == mf.tokens(2, 2) + mf.attention(6 + 7)


def test_timers_file_every_piece_and_undo_their_patches(tiny_model) -> None:
    import mlx.nn as nn

    from batchmlx.engine import core as engine_core
    from batchmlx.engine.kv import paged as kv_cache

    class Tok:
        def decode(self, ids):
            return ""

    loaded = SimpleNamespace(model=tiny_model, tokenizer=Tok(), context_length=256)
    before = (nn.Linear.__call__, kv_cache.BatchLayout.__dict__["build"], engine_core.sample)
    timers, phases = pm.profile_engine(loaded, pm.random_prompts(3, 20, 0, high=256), 4, 3)
    after = (nn.Linear.__call__, kv_cache.BatchLayout.__dict__["build"], engine_core.sample)
    assert before == after
    for bucket in ("model matmuls", "attention", "KV writes and gathers", "layout", "sampling"):
        assert timers.seconds[bucket] > 0, bucket
    assert phases.prefill_s > 0 and phases.decode_s > 0
    assert all(len(t) == 4 for t in phases.tokens)
