"""The per-token post-processing step alone (core/postprocess.py): a fake engine and grammar."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from batchmlx.core.finish import FinishRules
from batchmlx.core.postprocess import Generation, Postprocessor
from batchmlx.core.request import (
    CacheOutcome,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TokenLogprob,
)

EOS = 0
VOCAB = {1: "Hel", 2: "lo", 3: " wo", 4: "rld", 5: ".", 6: " E", 7: "ND"}


class Text:
    def decode(self, ids: list[int]) -> str:
        return "".join(VOCAB[i] for i in ids)


@dataclass
class FakeEngine:
    """What the step reads of an engine: its tokenizer and its stream callback."""

    tokenizer: object = None  # untouched unless a request has stop strings
    streamed: list[tuple[str, int]] = field(default_factory=list)

    def on_token(self, request_id: str, token: int) -> None:
        self.streamed.append((request_id, token))


class Grammar:
    """Complete once it has seen `done_at`; records what it was fed."""

    def __init__(self, done_at: int) -> None:
        self.done_at, self.fed = done_at, []

    def __call__(self, token: int) -> bool:
        self.fed.append(token)
        return token == self.done_at


def generation(max_tokens=None, stop=(), logprobs=False, grammar=None, context=100) -> Generation:
    params = SamplingParams(max_tokens=max_tokens, stop=stop, logprobs=logprobs)
    req = GenerationRequest("r", [9, 9], params, stop_token_ids=frozenset({EOS}))
    return Generation(req, FinishRules.for_request(req, context), added_at=1.0, grammar=grammar)


def lp(token: int) -> TokenLogprob:
    return TokenLogprob(token, -0.5)


def test_an_end_of_sequence_token_stops_and_is_not_output():
    engine, grammar = FakeEngine(), Grammar(done_at=-1)
    post, gen = Postprocessor(engine), generation(logprobs=True, grammar=grammar)
    assert post(gen, 1, lp(1), now=3.0) is None
    assert post(gen, EOS, lp(EOS), now=4.0) is FinishReason.STOP
    assert engine.streamed == [("r", 1)] and grammar.fed == [1]  # EOS: neither streamed nor fed
    assert post.generated_tokens == 2  # counted all the same
    out = gen.output()
    assert (out.token_ids, out.finish_reason) == ([1], FinishReason.STOP)
    assert out.logprobs == [lp(1)] and out.first_token_s == 2.0


def test_max_tokens_ends_with_length_the_token_output():
    engine = FakeEngine()
    post, gen = Postprocessor(engine), generation(max_tokens=2)
    assert post(gen, 1, None, 0.0) is None
    assert post(gen, 2, None, 0.0) is FinishReason.LENGTH
    out = gen.output(cached_tokens=4, cache_outcome=CacheOutcome.HIT, preemptions=1)
    assert (out.token_ids, out.finish_reason, out.logprobs) == ([1, 2], FinishReason.LENGTH, None)
    assert (out.prompt_tokens, out.cached_tokens, out.extra) == (2, 4, {"preemptions": 1.0})
    assert engine.streamed == [("r", 1), ("r", 2)]


def test_none_runs_until_the_context_is_full():
    post, gen = Postprocessor(FakeEngine()), generation(max_tokens=None, context=5)
    assert gen.rules.max_tokens == 3  # the room the prompt of 2 leaves
    assert [post(gen, t, None, 0.0) for t in (1, 2, 3)] == [None, None, FinishReason.LENGTH]


def test_a_completed_grammar_stops_with_the_token_output_ahead_of_length():
    grammar = Grammar(done_at=5)
    post, gen = Postprocessor(FakeEngine()), generation(max_tokens=2, grammar=grammar)
    assert post(gen, 4, None, 0.0) is None
    assert post(gen, 5, None, 0.0) is FinishReason.STOP  # also the last token max_tokens allows
    assert gen.output().token_ids == [4, 5] and grammar.fed == [4, 5]


def test_a_stop_string_in_the_decoded_tail_stops():
    post, gen = Postprocessor(FakeEngine(Text())), generation(stop=(" END",))
    assert [post(gen, t, None, 0.0) for t in (1, 2, 6)] == [None, None, None]
    assert post(gen, 7, None, 0.0) is FinishReason.STOP  # across two tokens
    out = gen.output()
    assert (out.token_ids, out.finish_reason) == ([1, 2, 6, 7], FinishReason.STOP)


def test_a_sequence_ended_outside_the_step_gives_length():
    post, gen = Postprocessor(FakeEngine()), generation()
    post(gen, 1, None, 0.0)
    out = gen.output()  # say, the unpaged engine's own length limit
    assert (out.token_ids, out.finish_reason) == ([1], FinishReason.LENGTH)


def test_the_engine_refuses_only_a_prompt_that_leaves_no_room():
    req = GenerationRequest("r", [1] * 10, SamplingParams(max_tokens=50))
    assert FinishRules.for_request(req, 20).max_tokens == 10  # bounded, not refused
    with pytest.raises(ValueError, match="no room"):
        FinishRules.for_request(req, 10)
    with pytest.raises(ValueError, match="empty prompt"):
        FinishRules.for_request(GenerationRequest("e", [], SamplingParams()), 10)
