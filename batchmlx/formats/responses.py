"""/v1/responses: a body's shape (file validation), the body → `ParsedRequest` (or OpenAI's 400)
at run time, and the Response object.

A response is a chat turn: `instructions` becomes the system message and `input` (a string, or
message items) the conversation. Parameters that need OpenAI's servers (stored responses,
conversations, hosted tools, background runs) are refused per request, never silently ignored.
"""

from __future__ import annotations

from typing import Any

from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.fields import (
    REQUIRED,
    Reject,
    content_text,
    fail,
    grammar_field,
    int_field,
    temperature_top_p,
    template_role,
    type_error,
)
from batchmlx.formats.media import MediaPart, check_media_bounds, responses_image
from batchmlx.formats.openai import ChoiceResult
from batchmlx.formats.request import Endpoint, ParsedRequest, sampling_params
from batchmlx.formats.structured import Grammar, responses_grammar

MIN_OUTPUT_TOKENS = 16  # OpenAI's minimum for max_output_tokens

_ACCEPTED = frozenset(
    {
        "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text",
        "metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier", "store",
        "stream", "truncation", "parallel_tool_calls", "tool_choice", "tools", "include",
        "reasoning", "top_logprobs", "background",
    }
)  # fmt: skip
# Real parameters that need state or services on OpenAI's side: a 400 whenever they are set.
_SERVER_ONLY = frozenset({"previous_response_id", "conversation", "prompt", "max_tool_calls"})
_TEXT_PARTS = ("input_text", "output_text", "text")


def _unsupported_parameter(key: str, why: str) -> Reject:
    return fail(
        ErrorCode.UNSUPPORTED_PARAMETER,
        f"Unsupported parameter: '{key}' is not supported with this model. {why}",
        key,
    )


def _check_keys(body: dict[str, Any]) -> None:
    for key, value in body.items():
        if key in _SERVER_ONLY:
            if value is not None:
                raise _unsupported_parameter(key, "batchmlx keeps no responses, conversations "
                                             "or prompts on a server.")  # fmt: skip
            continue
        if key not in _ACCEPTED:
            raise fail(
                ErrorCode.UNKNOWN_PARAMETER, f"Unrecognized request argument supplied: {key}", key
            )
    # accepted only at their local, no-op values
    if body.get("store") is True:
        raise _unsupported_parameter("store", "batchmlx stores no responses; set it to false.")
    if body.get("background") is True:
        raise _unsupported_parameter("background", "batch requests already run in background.")
    if body.get("stream") is True:
        raise _unsupported_parameter("stream", "streamed responses are not supported.")
    if body.get("tools"):
        raise _unsupported_parameter("tools", "batchmlx runs no tools.")
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise _unsupported_parameter("tool_choice", "batchmlx runs no tools.")
    if body.get("include"):
        raise _unsupported_parameter("include", "there is nothing extra to include.")
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and any(v is not None for v in reasoning.values()):
        raise _unsupported_parameter("reasoning", "the model does not reason.")
    if body.get("top_logprobs"):
        raise _unsupported_parameter("top_logprobs", "logprobs are not returned by responses.")
    truncation = body.get("truncation")
    if truncation not in (None, "auto", "disabled"):
        raise fail(
            ErrorCode.INVALID_VALUE,
            f"Invalid value for 'truncation': {truncation!r}. Supported values are: 'auto' "
            "and 'disabled'.",
            "truncation",
        )


def _refuse_part(param: str) -> Reject:
    return _unsupported_parameter(param, "only text and input_image content is supported.")


_MEDIA_READERS = {"input_image": responses_image}


def _messages(body: dict[str, Any]) -> tuple[tuple[dict[str, str], ...], tuple[MediaPart, ...]]:
    out: list[dict[str, str]] = []
    media: list[MediaPart] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise type_error("instructions", "a string", instructions)
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if items is None:
        raise fail(
            ErrorCode.MISSING_REQUIRED_PARAMETER, "Missing required parameter: 'input'.", "input"
        )
    if isinstance(items, str):
        return (*out, {"role": "user", "content": items}), ()
    if not isinstance(items, list):
        raise type_error("input", "a string or an array of input items", items)
    if not items:
        raise fail(ErrorCode.INVALID_VALUE, "Invalid 'input': expected a non-empty array.", "input")
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise type_error(at, "an object", item)
        kind = item.get("type", "message")
        if kind != "message":
            raise _unsupported_parameter(f"{at}.type", "only message items are supported.")
        role = template_role(item.get("role"), at)
        text = content_text(item.get("content"), f"{at}.content", _TEXT_PARTS, _refuse_part,
                            (_MEDIA_READERS, len(out), media))  # fmt: skip
        out.append({"role": role, "content": text})
    check_media_bounds(media)
    return tuple(out), tuple(media)


def _text_grammar(body: dict[str, Any]) -> Grammar | None:
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise type_error("text", "an object", text)
    return grammar_field(responses_grammar, text.get("format"))


def parse_responses(body: dict[str, Any]) -> ParsedRequest:
    """Raises `fields.Reject` (params.parse_request turns it into the RequestError)."""
    _check_keys(body)
    messages, media = _messages(body)
    max_tokens = int_field(body, "max_output_tokens", MIN_OUTPUT_TOKENS, None)
    temperature, top_p = temperature_top_p(body)
    for key in ("metadata",):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise type_error(key, "an object", body[key])
    return ParsedRequest(
        endpoint=Endpoint.RESPONSES,
        messages=messages,
        media=media,
        sampling=sampling_params(max_tokens, temperature, top_p),
        grammar=_text_grammar(body),
    )


def response_body(
    *,
    id: str,
    message_id: str,
    created: int,
    model: str,
    request: dict[str, Any],
    choice: ChoiceResult,
    input_tokens: int,
    output_tokens: int,
    cached_tokens: int,
) -> dict[str, Any]:
    """A `response` object (openai.types.responses.Response), echoing the request's settings."""
    cut = choice.finish_reason == "length"
    status = "incomplete" if cut else "completed"
    text = request.get("text")
    if not isinstance(text, dict):
        text = {}
    return {
        "id": id,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "model": model,
        "output": [
            {
                "type": "message",
                "id": message_id,
                "status": status,
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": choice.text, "annotations": [], "logprobs": []}
                ],
            }
        ],
        "parallel_tool_calls": request.get("parallel_tool_calls", True) is not False,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": request.get("temperature", 1.0),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": [],
        "top_p": request.get("top_p", 1.0),
        "truncation": request.get("truncation") or "disabled",
        "usage": {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens,
        },
        "user": request.get("user"),
        "metadata": request.get("metadata") or {},
    }


def check_responses_input(body: dict[str, Any]) -> tuple[str, str] | None:
    """The file-validation shape check of a responses body: (param, problem) or None."""
    items = body.get("input")
    if items is None:
        return "body.input", REQUIRED
    if isinstance(items, str) or (isinstance(items, list) and items):
        return None
    return "body.input", "must be a string or a non-empty array of input items"
