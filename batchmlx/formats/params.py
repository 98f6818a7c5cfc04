"""One request body → what the engine needs (`ParsedRequest`), or the 400 OpenAI would answer.

Validation (`formats.validate`) only checks a file's shape; the values are judged here, per
request, so one odd line fails alone with a 400 in the error file instead of failing the batch.
`null` counts as absent for every optional parameter, as in the OpenAI API.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from batchmlx.core.request import SamplingParams
from batchmlx.formats.errors import ErrorCode, json_type
from batchmlx.formats.structured import FormatError, Grammar, chat_grammar

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOPS = 4
MAX_N = 128
MAX_TOP_LOGPROBS = 20  # chat
MAX_COMPLETION_LOGPROBS = 5  # legacy completions


class Endpoint(enum.StrEnum):
    CHAT = "/v1/chat/completions"
    COMPLETIONS = "/v1/completions"
    RESPONSES = "/v1/responses"
    EMBEDDINGS = "/v1/embeddings"  # parsed by formats.embeddings; no generation


class Role(enum.StrEnum):
    """Chat message roles a batch file may hold."""

    SYSTEM = "system"
    DEVELOPER = "developer"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"  # well-formed, but refused per request: tools are not supported


# The role a local chat template sees; OpenAI treats "developer" as "system".
TEMPLATE_ROLE = {
    Role.SYSTEM: "system", Role.DEVELOPER: "system", Role.USER: "user", Role.ASSISTANT: "assistant",
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    endpoint: Endpoint
    messages: tuple[dict[str, str], ...] | None  # chat: {"role", "content": str}
    prompt: str | None  # completions given as text
    prompt_token_ids: tuple[int, ...] | None  # completions given as token ids
    n: int  # choices to generate
    sampling: SamplingParams  # max_tokens as requested: None = until the context is full
    logprobs: bool
    top_logprobs: int
    response_format: dict[str, Any] | None  # kept for the engine to honour what it can
    echo: bool  # completions only: the prompt is prepended to the text
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


class _Reject(Exception):
    """Carries a RequestError out of the nested checks; never leaves this module."""

    def __init__(self, error: RequestError) -> None:
        self.error = error


def _fail(code: ErrorCode, message: str, param: str | None) -> _Reject:
    return _Reject(RequestError(400, code.value, message, param))


# Parameters taken and honoured (or harmlessly ignored, like `user`), per endpoint.
_COMMON = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "logprobs", "stream",
        "stream_options", "user", "frequency_penalty", "presence_penalty", "logit_bias",
        "service_tier", "safety_identifier", "prompt_cache_key",
    }
)  # fmt: skip
_CHAT = _COMMON | {
    "messages", "max_completion_tokens", "top_logprobs", "response_format", "metadata", "store",
    "parallel_tool_calls",
}  # fmt: skip
_COMPLETIONS = _COMMON | {"prompt", "echo", "best_of", "suffix"}
# Real OpenAI parameters batchmlx cannot serve: a 400 unsupported_value when set.
_UNSUPPORTED = frozenset(
    {
        "tools", "tool_choice", "functions", "function_call", "reasoning_effort", "modalities",
        "audio", "prediction", "web_search_options", "verbosity",
    }
)  # fmt: skip
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _type_error(param: str, expected: str, value: Any) -> _Reject:
    return _fail(
        ErrorCode.INVALID_TYPE,
        f"Invalid type for '{param}': expected {expected}, but got {json_type(value)} instead.",
        param,
    )


def _int(body: dict[str, Any], key: str, lo: int | None, hi: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _type_error(key, "an integer", value)
    _check_range(key, value, lo, hi)
    return value


def _float(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _type_error(key, "a decimal", value)
    _check_range(key, value, lo, hi)
    return float(value)


def _bool(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise _type_error(key, "a boolean", value)
    return value


def _check_range(key: str, value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and value < lo:
        raise _fail(
            ErrorCode.INVALID_VALUE,
            f"Invalid '{key}': {value} is below the minimum; expected a value >= {lo}.",
            key,
        )
    if hi is not None and value > hi:
        raise _fail(
            ErrorCode.INVALID_VALUE,
            f"Invalid '{key}': {value} is above the maximum; expected a value <= {hi}.",
            key,
        )


def _unsupported(key: str, why: str) -> _Reject:
    return _fail(ErrorCode.UNSUPPORTED_VALUE, f"Unsupported value for '{key}': {why}", key)


def _check_keys(body: dict[str, Any], allowed: frozenset[str]) -> None:
    for key, value in body.items():
        if key in allowed:
            continue
        if key in _UNSUPPORTED:
            if value is None:
                continue
            raise _unsupported(key, "batchmlx does not support tools or this feature.")
        raise _fail(
            ErrorCode.UNKNOWN_PARAMETER, f"Unrecognized request argument supplied: {key}", key
        )


def _check_ignored(body: dict[str, Any]) -> None:
    """Parameters accepted only at their no-op values."""
    if body.get("stream") is not None:
        if _bool(body, "stream"):
            raise _unsupported("stream", "batch requests cannot stream.")
    for key in ("frequency_penalty", "presence_penalty"):
        if _float(body, key, -2.0, 2.0):
            raise _unsupported(key, "only 0 is supported.")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise _type_error("logit_bias", "an object", bias)
        if bias:
            raise _unsupported("logit_bias", "logit_bias is not supported.")
    for key in ("user", "service_tier", "safety_identifier", "prompt_cache_key"):
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise _type_error(key, "a string", value)
    for key in ("metadata", "stream_options"):
        value = body.get(key)
        if value is not None and not isinstance(value, dict):
            raise _type_error(key, "an object", value)
    _bool(body, "store")
    _bool(body, "parallel_tool_calls")


def _stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = stop
    else:
        raise _type_error("stop", "a string or an array of strings", stop)
    if len(stops) > MAX_STOPS:
        raise _fail(
            ErrorCode.INVALID_VALUE,
            f"Invalid 'stop': at most {MAX_STOPS} stop sequences are allowed, got {len(stops)}.",
            "stop",
        )
    if any(not s for s in stops):
        raise _fail(
            ErrorCode.INVALID_VALUE, "Invalid 'stop': stop sequences must not be empty.", "stop"
        )
    return tuple(stops)


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _type_error(param, "a string or an array of content parts", content)
    texts: list[str] = []
    for j, part in enumerate(content):
        at = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _type_error(at, "an object", part)
        if part.get("type") != "text":
            raise _unsupported(f"{at}.type", "only text content parts are supported.")
        text = part.get("text")
        if not isinstance(text, str):
            raise _type_error(f"{at}.text", "a string", text)
        texts.append(text)
    return "\n".join(texts)  # the parts of one message, a line each (vLLM does the same)


def _messages(body: dict[str, Any]) -> tuple[dict[str, str], ...]:
    messages = body.get("messages")
    if messages is None:
        raise _fail(
            ErrorCode.MISSING_REQUIRED_PARAMETER,
            "Missing required parameter: 'messages'.",
            "messages",
        )
    if not isinstance(messages, list):
        raise _type_error("messages", "an array", messages)
    if not messages:
        raise _fail(
            ErrorCode.INVALID_VALUE, "Invalid 'messages': expected a non-empty array.", "messages"
        )
    out: list[dict[str, str]] = []
    for i, msg in enumerate(messages):
        at = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _type_error(at, "an object", msg)
        if msg.get("tool_calls") or msg.get("function_call"):
            raise _unsupported(f"{at}.tool_calls", "tool calls are not supported.")
        role = msg.get("role")
        if role == "tool" or role == "function":
            raise _unsupported(f"{at}.role", "tool messages are not supported.")
        role = _check_role(role, at)
        # chat templates of local models know "system"; OpenAI treats "developer" the same way
        out.append(
            {
                "role": TEMPLATE_ROLE[Role(role)],
                "content": _content_text(msg.get("content"), f"{at}.content"),
            }
        )
    return tuple(out)


def _prompt(body: dict[str, Any]) -> tuple[str | None, tuple[int, ...] | None]:
    prompt = body.get("prompt")
    if prompt is None:
        raise _fail(
            ErrorCode.MISSING_REQUIRED_PARAMETER, "Missing required parameter: 'prompt'.", "prompt"
        )
    if isinstance(prompt, str):
        return prompt, None
    expected = "a string, an array of strings or an array of token ids"
    if not isinstance(prompt, list):
        raise _type_error("prompt", expected, prompt)
    if not prompt:
        raise _fail(
            ErrorCode.INVALID_VALUE, "Invalid 'prompt': expected a non-empty array.", "prompt"
        )
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if any(t < 0 for t in prompt):
            raise _fail(
                ErrorCode.INVALID_VALUE, "Invalid 'prompt': token ids must be >= 0.", "prompt"
            )
        return None, tuple(prompt)
    if len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise _unsupported("prompt", "one prompt per request is supported; send one line each.")
    only = prompt[0]
    if isinstance(only, str):
        return only, None
    if isinstance(only, list) and only:
        return _prompt({"prompt": only})
    raise _type_error("prompt", expected, prompt)


def _response_format(body: dict[str, Any]) -> tuple[dict[str, Any] | None, Grammar | None]:
    fmt = body.get("response_format")
    try:
        grammar = chat_grammar(fmt)
    except FormatError as exc:
        raise _fail(exc.code, exc.message, exc.param) from None
    return fmt, grammar


def _parse(endpoint: Endpoint, body: dict[str, Any]) -> ParsedRequest:
    chat = endpoint is Endpoint.CHAT
    _check_keys(body, _CHAT if chat else _COMPLETIONS)
    _check_ignored(body)

    messages = prompt = token_ids = None
    if chat:
        messages = _messages(body)
    else:
        prompt, token_ids = _prompt(body)

    max_tokens = _int(body, "max_tokens", 1, None)
    if chat:
        # the newer name wins: it is what the SDK sends, max_tokens is its deprecated alias
        max_tokens = _int(body, "max_completion_tokens", 1, None) or max_tokens
    elif max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS

    temperature = _float(body, "temperature", 0.0, 2.0)
    top_p = _float(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise _fail(ErrorCode.INVALID_VALUE, "Invalid 'top_p': expected a value > 0.", "top_p")
    seed = _int(body, "seed", None, None)
    n = _int(body, "n", 1, MAX_N) or 1
    stop = _stops(body)

    if chat:
        logprobs = bool(_bool(body, "logprobs"))
        top_logprobs = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if top_logprobs is not None and not logprobs:
            raise _fail(
                ErrorCode.INVALID_VALUE,
                "Invalid 'top_logprobs': 'logprobs' must be true when 'top_logprobs' is used.",
                "top_logprobs",
            )
        top_logprobs = top_logprobs or 0
        echo = False
    else:
        level = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
        logprobs, top_logprobs = level is not None, level or 0
        echo = bool(_bool(body, "echo"))
        best_of = _int(body, "best_of", 1, None)
        if best_of is not None and best_of != n:
            raise _unsupported("best_of", "best_of must equal n.")
        suffix = body.get("suffix")
        if suffix is not None and not isinstance(suffix, str):
            raise _type_error("suffix", "a string", suffix)
        if suffix:
            raise _unsupported("suffix", "suffix (insertion) is not supported.")

    response_format, grammar = _response_format(body) if chat else (None, None)
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=seed,
        stop=stop,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )
    return ParsedRequest(
        endpoint=endpoint,
        messages=messages,
        prompt=prompt,
        prompt_token_ids=token_ids,
        n=n,
        sampling=sampling,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        response_format=response_format,
        echo=echo,
        grammar=grammar,
    )


def parse_request(endpoint: str, body: dict[str, Any]) -> ParsedRequest | RequestError:
    """Judge one request body; never raises for bad input."""
    try:
        ep = Endpoint(endpoint)
    except ValueError:
        return RequestError(
            404, ErrorCode.INVALID_URL.value, f"Unsupported endpoint {endpoint!r}.", "url"
        )
    if not isinstance(body, dict):
        return RequestError(400, ErrorCode.INVALID_TYPE.value, "The body must be an object.", None)
    if ep is Endpoint.EMBEDDINGS:  # no generation: formats.embeddings parses these
        return RequestError(
            404, ErrorCode.INVALID_URL.value, "Embeddings are not a generation endpoint.", "url"
        )
    try:
        if ep is Endpoint.RESPONSES:
            from batchmlx.formats.responses import parse_responses  # it builds on this module

            return parse_responses(body)
        return _parse(ep, body)
    except _Reject as reject:
        return reject.error


def _check_role(role: Any, at: str) -> str:
    """A message's role, which must be one a chat template takes (chat messages, response
    items)."""
    if not isinstance(role, str) or role not in TEMPLATE_ROLE:
        raise _fail(
            ErrorCode.INVALID_VALUE,
            f"Invalid value for '{at}.role': {role!r}. Supported values are: "
            "'system', 'developer', 'user' and 'assistant'.",
            f"{at}.role",
        )
    return role


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
