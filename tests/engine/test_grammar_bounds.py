"""The compiled-schema cache is bounded by bytes and count, and compile errors are remembered in a
bounded LRU (the real tokenizer, no model). Before: bounded by count only, errors kept forever."""

from __future__ import annotations

import pytest

from batchmlx.engine import grammar
from batchmlx.engine.grammar import GrammarError, Grammars, estimated_bytes
from batchmlx.formats.structured import canonical_schema


@pytest.fixture(scope="module")
def grammars(tiny_model_dir) -> Grammars:
    from mlx_lm.utils import load_tokenizer

    return Grammars(load_tokenizer(tiny_model_dir), vocab_size=None)


def _schema(i: int, props: int = 3) -> str:
    return canonical_schema({"type": "object", "properties": {
        f"k{i}_{j}": {"type": "integer"} for j in range(props)}})  # fmt: skip


def test_templates_are_bounded_by_estimated_bytes(grammars, monkeypatch):
    budget = 3 * estimated_bytes(_schema(0, props=40))
    monkeypatch.setattr(grammar, "MAX_GRAMMAR_CACHE_BYTES", budget)
    for i in range(8):
        assert grammars.check(_schema(i, props=40)) is None
        assert grammars.stats.cached_bytes <= budget
    templates, _ = grammars.cached
    assert templates == 3  # the most recent ones, least recently used dropped
    # a dropped one compiles again; a kept one is a hit
    compiled = grammars.stats.compiled
    grammars.check(_schema(7, props=40))
    assert grammars.stats.compiled == compiled
    grammars.check(_schema(0, props=40))
    assert grammars.stats.compiled == compiled + 1
    # one schema over the whole budget is still served (and is then the only one kept)
    monkeypatch.setattr(grammar, "MAX_GRAMMAR_CACHE_BYTES", 1)
    assert grammars.check(_schema(99)) is None and grammars.cached[0] == 1


def test_compile_errors_are_a_bounded_lru(grammars, monkeypatch):
    monkeypatch.setattr(grammar, "MAX_CACHED_ERRORS", 4)
    bad = [canonical_schema({"type": "array", "uniqueItems": True, "maxItems": i})
           for i in range(10)]  # fmt: skip
    for s in bad:
        assert "uniqueItems" in (grammars.check(s) or "")
    assert grammars.cached[1] == 4
    with pytest.raises(GrammarError):
        grammars.matcher(bad[-1])  # a remembered one still raises
