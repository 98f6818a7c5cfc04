"""Numbers in constrained answers end: after the bound's digits the real grammar matcher (the
default model's tokenizer, no model) allows only what closes the number. Before: digits were
allowed for ever, and only `max_tokens` ended the answer."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from batchmlx.core.json_bounds import NUMBER_BOUNDS
from batchmlx.engine.grammar import Grammars
from batchmlx.formats.structured import canonical_schema

DIGITS = NUMBER_BOUNDS.mantissa_digits  # 20


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def grammars(tok) -> Grammars:
    return Grammars(tok, vocab_size=None)


def obj(value: dict) -> str:
    return canonical_schema({
        "type": "object", "properties": {"n": value}, "required": ["n"],
        "additionalProperties": False,
    })  # fmt: skip


def feed(grammars: Grammars, tok, schema: str, text: str):
    constraint = grammars.matcher(schema)
    for t in tok.encode(text, add_special_tokens=False):
        assert t in allowed(grammars, constraint), (text, tok.decode([t]))
        Grammars.advance(constraint, t)
    return constraint


def allowed(grammars: Grammars, constraint) -> set[int]:
    vocab = grammars.tokenizer.vocab_size
    logits = grammars.mask(mx.zeros((1, vocab)), [(constraint, 0)])
    return set(np.flatnonzero(np.isfinite(np.array(logits[0]))).tolist())


def texts(tok, ids: set[int]) -> set[str]:
    return {tok.decode([i]) for i in ids}


@pytest.mark.parametrize(
    ("schema", "closers"),
    [
        (obj({"type": "integer"}), {"}"}),
        (obj({"type": "number"}), {"}", "e", "E"}),  # a fraction would be a 21st digit
        (canonical_schema({"type": "object"}), {"}", ",", "e", "E"}),  # json_object: any value
    ],
)
def test_after_the_bound_only_closing_tokens_are_allowed(grammars, tok, schema, closers):
    c = feed(grammars, tok, schema, '{"n": ' + "1" * (DIGITS - 1))
    assert any(s[:1].isdigit() for s in texts(tok, allowed(grammars, c)))  # 19: digits go on
    c = feed(grammars, tok, schema, '{"n": ' + "1" * DIGITS)
    nxt = texts(tok, allowed(grammars, c))
    assert nxt and not any(any(ch.isdigit() for ch in s) for s in nxt), sorted(nxt)[:20]
    assert {s[:1] for s in nxt} <= closers, sorted(nxt)
    assert "}" in nxt


def test_exponent_and_fraction_are_bounded_too(grammars, tok):
    schema = obj({"type": "number"})
    for text in ("1." + "2" * (DIGITS - 1), "0." + "0" * DIGITS, "-5e" + "1" * 3):
        nxt = texts(tok, allowed(grammars, feed(grammars, tok, schema, '{"n": ' + text)))
        assert not any(s[:1].isdigit() for s in nxt), (text, sorted(nxt)[:20])
        assert "}" in nxt


def test_a_schema_that_needs_longer_numbers_wins(grammars, tok):
    """Every value in [1e-22, 2e-22] written without an exponent (llguidance's ranges have none)
    takes 23 fraction digits: the bound gives way for that sequence, and the answer still ends."""
    before = grammars.stats.unbounded
    schema = obj({"type": "number", "minimum": 1e-22, "maximum": 2e-22})
    c = feed(grammars, tok, schema, '{"n": 0.' + "0" * 21 + "15}")
    assert c.bound is None and grammars.stats.unbounded == before + 1
    assert Grammars.complete(c) or allowed(grammars, c) == {grammars.tokenizer.eos_token}


def test_without_bounds_numbers_run_on(tok):
    """number_bounds=None: llguidance's own grammar, digits without end (the old behaviour)."""
    grammars = Grammars(tok, vocab_size=None, number_bounds=None)
    c = feed(grammars, tok, obj({"type": "integer"}), '{"n": ' + "1" * 40)
    assert any(s[:1].isdigit() for s in texts(tok, allowed(grammars, c)))


POPULATION = {
    "type": "object",
    "properties": {
        "country": {"type": "string", "enum": ["Peru", "Japan"]},
        "population_millions": {"type": "number"},
        "rank": {"type": "integer"},
        "history": {"type": "array", "items": {"type": "number"}, "maxItems": 2},
    },
    "required": ["country", "population_millions", "rank", "history"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def digit_lover(tok):
    """A random-weight llama with the default model's vocabulary whose head prefers digits by
    far (a bias of +30 on "0".."9"): greedy, it writes digits wherever a grammar lets it."""
    import mlx.nn as nn
    from mlx_lm.models import llama

    from tests.tiny_model import CONFIG

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict({**CONFIG, "tie_word_embeddings": False}))
    head = nn.Linear(CONFIG["hidden_size"], CONFIG["vocab_size"], bias=True)
    digits = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    bias = np.zeros(CONFIG["vocab_size"], dtype=np.float32)
    bias[digits] = 30.0
    head.bias = mx.array(bias)
    model.lm_head = head
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("paged", [True, False])
def test_a_digit_loving_model_closes_its_json(digit_lover, tok, paged):
    """Greedy under a schema of numbers, the answer ends with `stop` and parses, for the paged
    engine and the mlx-lm one alike. Before: "population_millions": 1111... to max_tokens."""
    import json
    import math
    import re

    import jsonschema

    from batchmlx.core.engine_api import EngineSettings
    from batchmlx.core.request import FinishReason, GenerationRequest, SamplingParams
    from batchmlx.engine.runners.mlx_lm import mlx_lm_engine
    from batchmlx.engine.runners.paged import paged_engine

    kind = paged_engine if paged else mlx_lm_engine
    engine = kind(digit_lover, tok, context_length=512,
                  config=EngineSettings(max_batch_size=4, cache_memory_mb=64), seed=0)  # fmt: skip
    schema = canonical_schema(POPULATION)
    eos = frozenset({tok.eos_token_id})
    params = SamplingParams(max_tokens=200, temperature=0.0)
    prompt = list(tok.encode("Population of Peru, as JSON:", add_special_tokens=False))
    reqs = [GenerationRequest(f"r{i}", prompt[i:], params, eos, grammar=schema) for i in range(3)]
    texts = []
    for out in engine.generate(reqs):
        text = tok.decode(out.token_ids)
        assert out.finish_reason is FinishReason.STOP, text
        value = json.loads(text)
        jsonschema.validate(value, POPULATION)
        assert list(value) == list(POPULATION["properties"]), text  # the schema's order, as OpenAI
        assert math.isfinite(value["population_millions"]), text
        assert len(out.token_ids) < 120, text
        texts.append(text)
    # the model did run its digits to the bound: the bound, not the model, closed them
    assert any(re.search(rf'"rank": -?[0-9]{{{DIGITS}}}', t) for t in texts), texts
