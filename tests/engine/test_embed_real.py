"""Embeddings from the default model: mean-pooled, normalized, the same alone and batched."""

from __future__ import annotations

import numpy as np
import pytest

from batchmlx.engine.embed import Embedder

pytestmark = pytest.mark.real_model

TEXTS = ["The cat sat on the mat.", "Paris is the capital of France.", "Hi", "Two plus two."]


def test_embeddings_are_unit_vectors_and_batching_changes_nothing(default_model):
    tok = default_model.tokenizer
    emb = Embedder(default_model.model)
    assert emb.dimensions == 576  # SmolLM2-135M's hidden size
    ids = [list(tok.encode(t)) for t in TEXTS]
    batched = emb.embed(ids)
    alone = [emb.embed([i])[0] for i in ids]
    for b, a in zip(batched, alone, strict=True):
        assert b.shape == (576,) and b.dtype == np.float32
        assert np.linalg.norm(b) == pytest.approx(1.0, abs=1e-5)
        np.testing.assert_allclose(b, a, atol=2e-4)  # padding never leaks into a vector
    # different texts, different vectors; the same text, the same vector
    assert float(batched[0] @ batched[1]) < 0.9999
    np.testing.assert_allclose(emb.embed([ids[0], ids[0]])[1], batched[0], atol=2e-4)
