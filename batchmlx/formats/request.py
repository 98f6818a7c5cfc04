"""What a generation request becomes once its body is judged: `ParsedRequest` for the engine, or
`RequestError`, the 400 OpenAI would answer. The endpoint modules (chat, completions, responses)
build them; `formats.params.parse_request` picks the module by url."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchmlx.core.request import SamplingParams
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.structured import Grammar

if TYPE_CHECKING:  # formats.media builds on fields, which builds on this module
    from batchmlx.formats.media import MediaPart


class Endpoint(enum.StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"
    EMBEDDINGS = "/v1/embeddings"  # parsed by formats.embeddings; no generation


# Keyword-only, so each endpoint names only what it sets; the defaults are the absent values.
@dataclass(frozen=True, slots=True, kw_only=True)
class ParsedRequest:
    endpoint: Endpoint
    messages: tuple[dict[str, str], ...] | None = None  # chat: {"role", "content": str}
    # chat and responses: images and videos in body order, each naming its message
    media: tuple[MediaPart, ...] = ()
    prompt: str | None = None  # completions given as text
    prompt_token_ids: tuple[int, ...] | None = None  # completions given as token ids
    n: int = 1  # choices to generate
    sampling: SamplingParams  # max_tokens as requested: None = until the context is full
    logprobs: bool = False
    top_logprobs: int = 0
    response_format: dict[str, Any] | None = None  # kept for the engine to honour what it can
    echo: bool = False  # completions only: the prompt is prepended to the text
    grammar: Grammar | None = None  # structured output: decoding is constrained to its schema


@dataclass(frozen=True, slots=True)
class RequestError:
    status_code: int  # 400
    code: str  # an ErrorCode value
    message: str
    param: str | None
    type: str = "invalid_request_error"

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def sampling_params(
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    *,
    seed: int | None = None,
    stop: tuple[str, ...] = (),
    logprobs: bool = False,
    top_logprobs: int = 0,
) -> SamplingParams:
    """The engine's sampling settings from the values a body gave (None: absent)."""
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=seed,
        stop=stop,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def context_length_error(
    context: int, prompt_tokens: int, endpoint: Endpoint, max_tokens: int | None = None
) -> RequestError:
    """The 400 for a prompt (plus the completion it asks for) past the model's context, in
    OpenAI's words; never a 500, never a silent clamp."""
    where = _PROMPT_PARAM.get(endpoint, "prompt")
    if max_tokens is None:
        detail = f"your {where} resulted in {prompt_tokens} tokens. Please reduce the length of "
        detail += f"the {where}."
    else:
        detail = (
            f"you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
            f"{where}, {max_tokens} in the completion). Please reduce the length of the "
            f"{where} or completion."
        )
    return RequestError(
        400,
        ErrorCode.CONTEXT_LENGTH_EXCEEDED.value,
        f"This model's maximum context length is {context} tokens. However, {detail}",
        where,
    )


_PROMPT_PARAM = {Endpoint.CHAT: "messages", Endpoint.RESPONSES: "input"}
