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
    pending, gens, result = tr.prepare(claimed("x" * 9))  # one token of room: accepted
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
