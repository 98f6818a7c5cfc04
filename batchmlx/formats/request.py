"""What a generation request becomes once its body is judged: `ParsedRequest` for the engine, or
`RequestError`, the 400 OpenAI would answer. The endpoint modules (chat, completions, responses)
build them; `formats.params.parse_request` picks the module by url. A request's images and
videos are `MediaPart`s (read from the body's parts by formats.media), keyed by `content_digest`."""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, replace
from typing import Any

from batchmlx.core.request import SamplingParams
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.structured import Grammar


class Endpoint(enum.StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"
    EMBEDDINGS = "/v1/embeddings"  # parsed by formats.embeddings; no generation


class MediaKind(enum.StrEnum):
    IMAGE = "image"
    VIDEO = "video"


class MediaSource(enum.StrEnum):
    DATA = "data"  # a data: URL, bytes in the body
    HTTPS = "https"  # fetched by the worker, where the machine has a network
    FILE = "file"  # read by the worker, only inside a folder the user allows


@dataclass(frozen=True, slots=True)
class MediaPart:
    """One image or video of a request, where it sits and what it holds."""

    kind: MediaKind
    source: MediaSource
    param: str  # the part's place in the body, for errors: "messages[0].content[1]"
    message: int  # index of the message (ParsedRequest.messages) the part belongs to
    url: str  # as given (a data: URL is kept short: its media type only)
    media_type: str | None = None  # from a data: URL ("image/png"); None until known
    data: bytes | None = None  # the bytes: set for data: URLs, by the worker for the others
    detail: str = "auto"  # images: OpenAI's detail hint
    fps: float | None = None  # videos: frames sampled per second
    max_frames: int | None = None  # videos: frames at most
    # the prefix-cache key of the content (`content_digest`), set with the bytes: hashed once
    digest: bytes | None = None

    def with_data(self, data: bytes, media_type: str | None) -> MediaPart:
        """The part once its bytes are known (fetched or read by the worker), hashed."""
        part = replace(self, data=data, media_type=media_type or self.media_type)
        return replace(part, digest=content_digest(part))


def content_digest(part: MediaPart) -> bytes:
    """16 bytes of blake2b over the part's bytes; a video's also over fps and max_frames, as the
    reference design keys them (hash(video) + hash(fps) + hash(max_frames))."""
    if part.data is None:
        raise ValueError(f"{part.param}: the part's bytes are not known yet")
    h = hashlib.blake2b(digest_size=16)
    h.update(part.kind.value.encode())
    h.update(part.data)
    if part.kind is MediaKind.VIDEO:
        h.update(f"|fps={part.fps}|max_frames={part.max_frames}".encode())
    return h.digest()


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
