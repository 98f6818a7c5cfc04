"""/v1/chat/completions: a body's shape (file validation), the body → `ParsedRequest` (or
OpenAI's 400) at run time, and the chat.completion object.

The file check refuses only a body with no array of messages, so the file fails whole; what the
messages hold (roles, contents, tool calls, content parts) is judged per request and a bad one
becomes that line's 400, as OpenAI does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Unpack

from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.fields import (
    COMMON_KEYS,
    REQUIRED,
    Reject,
    SamplingFields,
    bool_field,
    check_keys,
    check_no_ops,
    content_text,
    fail,
    grammar_field,
    int_field,
    template_role,
    type_error,
    unsupported,
)
from batchmlx.formats.media import MediaPart, chat_image, chat_video, check_media_bounds
from batchmlx.formats.openai import (
    ChoiceResult,
    Envelope,
    TokenLogprobText,
    clamp_logprob,
    completion_object,
    finish_value,
)
from batchmlx.formats.request import Endpoint, ParsedRequest
from batchmlx.formats.structured import chat_grammar

MAX_TOP_LOGPROBS = 20
_KEYS = COMMON_KEYS | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "metadata", "store",
    "parallel_tool_calls",
}  # fmt: skip


def _calls_tools(msg: dict[str, Any]) -> bool:
    return bool(msg.get("tool_calls") or msg.get("function_call"))


def check_chat(body: dict[str, Any]) -> tuple[str, str] | None:
    """The file-validation check: (param, problem) or None. Only `messages` being an array is
    the file's; what the messages hold is judged per request (`_messages`), as OpenAI does."""
    messages = body.get("messages")
    if messages is None:
        return "body.messages", REQUIRED
    if not isinstance(messages, list):
        return "body.messages", "must be an array"
    return None


def _refuse_part(param: str) -> Reject:
    return unsupported(param, "only text, image_url and video_url content parts are supported.")


_MEDIA_READERS = {"image_url": chat_image, "video_url": chat_video}


def _messages(body: dict[str, Any]) -> tuple[tuple[dict[str, str], ...], tuple[MediaPart, ...]]:
    messages = body.get("messages")
    if messages is None:
        raise fail(
            ErrorCode.MISSING_REQUIRED_PARAMETER,
            "Missing required parameter: 'messages'.",
            "messages",
        )
    if not isinstance(messages, list):
        raise type_error("messages", "an array", messages)
    if not messages:
        raise fail(
            ErrorCode.INVALID_VALUE, "Invalid 'messages': expected a non-empty array.", "messages"
        )
    out: list[dict[str, str]] = []
    media: list[MediaPart] = []
    for i, msg in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise type_error(at, "an object", msg)
        if _calls_tools(msg):
            raise unsupported(f"{at}.tool_calls", "tool calls are not supported.")
        role = msg.get("role")
        if role == "tool" or role == "function":
            raise unsupported(f"{at}.role", "tool messages are not supported.")
        # chat templates of local models know "system"; OpenAI treats "developer" the same way
        out.append(
            {
                "role": template_role(role, at),
                "content": content_text(msg.get("content"), f"{at}.content", ("text",),
                                        _refuse_part, (_MEDIA_READERS, i, media)),
            }
        )  # fmt: skip
    check_media_bounds(media)
    return tuple(out), tuple(media)


def parse_chat(body: dict[str, Any]) -> ParsedRequest:
    """Raises `fields.Reject` (params.parse_request turns it into the RequestError)."""
    check_keys(body, _KEYS)
    check_no_ops(body)
    messages, media = _messages(body)
    max_tokens = int_field(body, "max_tokens", 1, None)
    # the newer name wins: it is what the SDK sends, max_tokens is its deprecated alias
    max_tokens = int_field(body, "max_completion_tokens", 1, None) or max_tokens
    fields = SamplingFields.read(body)
    logprobs = bool(bool_field(body, "logprobs"))
    top_logprobs = int_field(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top_logprobs is not None and not logprobs:
        raise fail(
            ErrorCode.INVALID_VALUE,
            "Invalid 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is used.",
            "top_logprobs",
        )
    top_logprobs = top_logprobs or 0
    response_format = body.get("response_format")
    return ParsedRequest(
        endpoint=Endpoint.CHAT,
        messages=messages,
        media=media,
        n=fields.n,
        sampling=fields.params(max_tokens, logprobs, top_logprobs),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        response_format=response_format,
        grammar=grammar_field(chat_grammar, response_format),
    )


def _chat_logprobs(tokens: list[TokenLogprobText] | None) -> dict[str, Any] | None:
    if tokens is None:
        return None
    content = [
        {
            "token": t.token,
            "logprob": clamp_logprob(t.logprob),
            "bytes": list(t.bytes),
            "top_logprobs": [
                {"token": tok, "logprob": clamp_logprob(lp), "bytes": list(b)}
                for tok, lp, b in t.top
            ],
        }
        for t in tokens
    ]
    return {"content": content, "refusal": None}


def chat_completion_body(
    *, choices: Sequence[ChoiceResult], **envelope: Unpack[Envelope]
) -> dict[str, Any]:
    """A `chat.completion` object (openai.types.chat.ChatCompletion)."""
    rendered = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text, "refusal": None},
            "logprobs": _chat_logprobs(c.logprobs),
            "finish_reason": finish_value(c.finish_reason),
        }
        for c in choices
    ]
    return completion_object("chat.completion", rendered, **envelope)
