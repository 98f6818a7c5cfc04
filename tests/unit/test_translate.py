"""The worker's translator with a fake tokenizer: context length once, as a 400, and stop strings
cut with core/finish's rules."""

from __future__ import annotations

from batchmlx.core.records import ClaimedRequest
from batchmlx.core.request import CacheOutcome, FinishReason, GenerationOutput
from batchmlx.worker.translate import Translator


class CharTokenizer:
    """One token per character."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> str:
        return "".join(m["content"] for m in messages)


def claimed(prompt: str, **body) -> ClaimedRequest:
    return ClaimedRequest(
        id=7, batch_id="b", custom_id="c", line=1, endpoint="/v1/completions", model="m",
        body={"model": "m", "prompt": prompt, **body}, attempts=1,
    )  # fmt: skip


def test_a_prompt_that_fills_the_context_is_a_400_not_an_engine_error():
    tr = Translator(CharTokenizer(), "m", context_length=10, eos_ids=[0])
    pending, gens, result = tr.prepare(claimed("x" * 10))
    assert pending is None and gens == []
    assert result is not None and result.status_code == 400
    assert result.body["error"]["code"] == "context_length_exceeded"
    assert result.body["error"]["param"] == "prompt"
    assert "maximum context length is 10 tokens" in result.body["error"]["message"]
    pending, gens, result = tr.prepare(claimed("x" * 9, max_tokens=1))  # room for one: taken
    assert result is None and len(gens) == 1


def test_max_tokens_past_what_the_context_leaves_is_a_400_not_a_clamp():
    tr = Translator(CharTokenizer(), "m", context_length=10, eos_ids=[0])
    _, gens, result = tr.prepare(claimed("x" * 6, max_tokens=5))
    assert gens == [] and result is not None and result.status_code == 400
    assert result.body["error"]["code"] == "context_length_exceeded"
    assert result.body["error"]["message"] == (
        "This model's maximum context length is 10 tokens. However, you requested 11 tokens "
        "(6 in the prompt, 5 in the completion). Please reduce the length of the prompt or "
        "completion."
    )
    # completions count their default max_tokens (16), as OpenAI's do
    _, _, result = tr.prepare(claimed("x" * 9))
    assert (
        result is not None
        and "9 in the prompt, 16 in the completion" in (result.body["error"]["message"])
    )
    _, gens, result = tr.prepare(claimed("x" * 6, max_tokens=4))  # exactly full: accepted
    assert result is None and len(gens) == 1


def test_the_text_is_cut_before_the_first_stop_string():
    tr = Translator(CharTokenizer(), "m", context_length=100, eos_ids=[0])
    pending, gens, _ = tr.prepare(claimed("Hi", stop=["!", " w"], max_tokens=12))
    assert pending is not None
    text = "Hello world!"
    pending.outputs[0] = GenerationOutput(
        request_id=gens[0].request_id, prompt_tokens=2, cached_tokens=0,
        cache_outcome=CacheOutcome.MISS, token_ids=[ord(c) for c in text],
        finish_reason=FinishReason.LENGTH,
    )  # fmt: skip
    choice = tr.result(pending, now=0).body["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("Hello", "stop")


def _answer(tr: Translator, pending, text: str, finish: FinishReason) -> tuple[str, str]:
    pending.outputs[0] = GenerationOutput(
        request_id="7:0", prompt_tokens=2, cached_tokens=0, cache_outcome=CacheOutcome.MISS,
        token_ids=[ord(c) for c in text], finish_reason=finish,
    )  # fmt: skip
    choice = tr.result(pending, now=0).body["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def test_a_constrained_answer_that_is_not_complete_json_is_never_stop():
    """Before: `{"` with finish_reason stop (a grammar that failed, or a stop string)."""
    tr = Translator(CharTokenizer(), "m", context_length=100, eos_ids=[0])
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
            "response_format": {"type": "json_object"}, "stop": ["!"]}  # fmt: skip
    c = ClaimedRequest(7, "b", "c", 1, "/v1/chat/completions", "m", body, 1)
    pending, _, error = tr.prepare(c)
    assert error is None
    assert _answer(tr, pending, '{"', FinishReason.STOP) == ('{"', "length")
    assert _answer(tr, pending, '{"a": "x!"}', FinishReason.LENGTH) == ('{"a": "x', "length")
    assert _answer(tr, pending, '{"a": 1}', FinishReason.STOP) == ('{"a": 1}', "stop")


def test_prompt_token_ids_past_the_vocabulary_or_int32_are_a_400():
    known = Translator(CharTokenizer(), "m", context_length=100, eos_ids=[0], vocab_size=50)
    unknown = Translator(CharTokenizer(), "m", context_length=100, eos_ids=[0])
    for tr, ids, words in (
        (known, [1, 50], "token id 50 is out of range; this model's vocabulary has 50 tokens"),
        (known, [2**31], "token id 2147483648 is out of range; this model's vocabulary"),
        (unknown, [2**31], "32 bits"),
        (known, [-1], "must be >= 0"),
    ):
        c = ClaimedRequest(7, "b", "c", 1, "/v1/completions", "m", {"model": "m", "prompt": ids}, 1)
        _, gens, result = tr.prepare(c)
        assert gens == [] and result is not None and result.status_code == 400
        err = result.body["error"]
        assert err["param"] == "prompt" and err["code"] == "invalid_value"
        assert words in err["message"]
