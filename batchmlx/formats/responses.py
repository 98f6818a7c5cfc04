"""/v1/responses: a request body → `ParsedRequest` (or OpenAI's 400), and the Response object.

A response is a chat turn: `instructions` becomes the system message and `input` (a string, or
message items) the conversation. Parameters that need OpenAI's servers (stored responses,
conversations, hosted tools, background runs) are refused per request, never silently ignored.
"""

from __future__ import annotations

from typing import Any

from batchmlx.core.request import SamplingParams
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.openai import ChoiceResult
from batchmlx.formats.params import (
    TEMPLATE_ROLE,
    Endpoint,
    ParsedRequest,
    Role,
    _check_role,
    _fail,
    _float,
    _int,
    _Reject,
    _type_error,
)
from batchmlx.formats.structured import FormatError, Grammar, responses_grammar

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


def _unsupported_parameter(key: str, why: str) -> _Reject:
    return _fail(
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
            raise _fail(
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
        raise _fail(
            ErrorCode.INVALID_VALUE,
            f"Invalid value for 'truncation': {truncation!r}. Supported values are: 'auto' "
            "and 'disabled'.",
            "truncation",
        )


def _content(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _type_error(at, "a string or an array of content parts", content)
    texts = []
    for j, part in enumerate(content):
        where = f"{at}[{j}]"
        if not isinstance(part, dict):
            raise _type_error(where, "an object", part)
        if part.get("type") not in _TEXT_PARTS:
            raise _unsupported_parameter(f"{where}.type", "only text content is supported.")
        text = part.get("text")
        if not isinstance(text, str):
            raise _type_error(f"{where}.text", "a string", text)
        texts.append(text)
    return "\n".join(texts)


def _messages(body: dict[str, Any]) -> tuple[dict[str, str], ...]:
    out: list[dict[str, str]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _type_error("instructions", "a string", instructions)
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if items is None:
        raise _fail(
            ErrorCode.MISSING_REQUIRED_PARAMETER, "Missing required parameter: 'input'.", "input"
        )
    if isinstance(items, str):
        return (*out, {"role": "user", "content": items})
    if not isinstance(items, list):
        raise _type_error("input", "a string or an array of input items", items)
    if not items:
        raise _fail(
            ErrorCode.INVALID_VALUE, "Invalid 'input': expected a non-empty array.", "input"
        )
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise _type_error(at, "an object", item)
        kind = item.get("type", "message")
        if kind != "message":
            raise _unsupported_parameter(f"{at}.type", "only message items are supported.")
        role = item.get("role")
        role = _check_role(role, at)
        text = _content(item.get("content"), f"{at}.content")
        out.append({"role": TEMPLATE_ROLE[Role(role)], "content": text})
    return tuple(out)


def _text_grammar(body: dict[str, Any]) -> Grammar | None:
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _type_error("text", "an object", text)
    try:
        return responses_grammar(text.get("format"))
    except FormatError as exc:
        raise _fail(exc.code, exc.message, exc.param) from None


def parse_responses(body: dict[str, Any]) -> ParsedRequest:
    """Raises `_Reject` (through params.parse_request, which turns it into a RequestError)."""
    _check_keys(body)
    messages = _messages(body)
    max_tokens = _int(body, "max_output_tokens", MIN_OUTPUT_TOKENS, None)
    temperature = _float(body, "temperature", 0.0, 2.0)
    top_p = _float(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise _fail(ErrorCode.INVALID_VALUE, "Invalid 'top_p': expected a value > 0.", "top_p")
    for key in ("metadata",):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise _type_error(key, "an object", body[key])
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
    )
    return ParsedRequest(
        endpoint=Endpoint.RESPONSES,
        messages=messages,
        prompt=None,
        prompt_token_ids=None,
        n=1,
        sampling=sampling,
        logprobs=False,
        top_logprobs=0,
        response_format=None,
        echo=False,
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
        return "body.input", "is required"
    if isinstance(items, str) or (isinstance(items, list) and items):
        return None
    return "body.input", "must be a string or a non-empty array of input items"
