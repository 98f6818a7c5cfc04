"""The translator's image rules (worker/translate.py): a text-only model refuses an image line
with a 400 naming the model and the part; the media reader's refusals reach the line; structured
outputs are refused on a vision model. No engine runs: the refusals come before it."""

from __future__ import annotations

import base64

from batchmlx.core.records import ClaimedRequest
from batchmlx.worker.build import _no_grammar
from batchmlx.worker.media import MediaReader
from batchmlx.worker.translate import Translator

IMAGE = "data:image/png;base64," + base64.b64encode(b"\x89PNG fake").decode()


def claimed(content: list, **extra) -> ClaimedRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": content}], **extra}
    return ClaimedRequest(1, "b", "c", 1, "/v1/chat/completions", "m", body, 1)


def error(t: Translator, c: ClaimedRequest) -> dict:
    pending, gens, result = t.prepare(c)
    assert pending is None and gens == [] and result is not None
    assert result.status_code == 400
    return result.body["error"]


class NoTokenizer:
    def __getattr__(self, name):
        raise AssertionError(f"the tokenizer was used ({name}) for a refused line")


def test_a_text_only_model_names_itself_and_the_part():
    t = Translator(NoTokenizer(), "tiny-llama", 2048, [2])
    parts = [{"type": "text", "text": "What is it?"},
             {"type": "image_url", "image_url": {"url": IMAGE}}]  # fmt: skip
    e = error(t, claimed(parts))
    assert (e["code"], e["param"]) == ("unsupported_value", "messages[0].content[1].image_url.url")
    assert "the model 'tiny-llama' is text-only" in e["message"]


class Refusing:
    """A vision prompter that must not be reached."""

    def prompt(self, messages, media):
        raise AssertionError("the prompt was built for a refused line")


def test_media_reader_refusals_and_structured_outputs_on_a_vision_model():
    t = Translator(NoTokenizer(), "tiny-llava", 2048, [2], vision=Refusing(),
                   grammar_check=_no_grammar, media=MediaReader(fetch_enabled=False))  # fmt: skip
    e = error(t, claimed([{"type": "image_url", "image_url": "https://example.com/a.png"}]))
    assert e["param"] == "messages[0].content[0].image_url" and "turned off" in e["message"]
    e = error(t, claimed([{"type": "image_url", "image_url": "/etc/passwd"}]))
    assert e["code"] == "unsupported_value" and "BATCHMLX_MEDIA_DIR" in e["message"]
    e = error(t, claimed([{"type": "image_url", "image_url": IMAGE}],
                         response_format={"type": "json_object"}))  # fmt: skip
    assert "not supported on vision-language models" in e["message"]
