"""The field checks every endpoint's body parser shares, each rule written once: integers,
decimals, booleans, stop sequences, roles, text content parts, the keys chat and completions
take, and the shape of a prompt or embeddings input.

A check raises `Reject` (a `RequestError` inside) for the first bad field; the endpoint's parser
lets it travel up to `formats.params.parse_request`, which returns the error. `null` counts as
absent for every optional parameter, as in the OpenAI API.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

from batchmlx.core.request import SamplingParams
from batchmlx.formats.errors import ErrorCode, json_type
from batchmlx.formats.request import MediaPart, RequestError, sampling_params
from batchmlx.formats.structured import FormatError, Grammar

MAX_STOPS = 4  # stop sequences per request (OpenAI's cap)
MAX_STOP_CHARS = 1024  # characters of one stop sequence: each token's tail decode covers it
MAX_N = 128  # choices per request (OpenAI's cap)
MAX_TOKEN_ID = 2**31 - 1  # token ids must fit the engine's int32 arrays (the vocab is smaller)
REQUIRED = "is required"  # the file check's problem for a body's missing input field


class Reject(Exception):
    """Carries a RequestError out of the nested checks, up to `parse_request`."""

    def __init__(self, error: RequestError) -> None:
        self.error = error


def fail(code: ErrorCode, message: str, param: str | None) -> Reject:
    return Reject(RequestError(400, code.value, message, param))


def type_error(param: str, expected: str, value: Any) -> Reject:
    return fail(
        ErrorCode.INVALID_TYPE,
        f"Invalid type for '{param}': expected {expected}, but got {json_type(value)} instead.",
        param,
    )


def unsupported(key: str, why: str) -> Reject:
    return fail(ErrorCode.UNSUPPORTED_VALUE, f"Unsupported value for '{key}': {why}", key)


def int_field(body: dict[str, Any], key: str, lo: int | None, hi: int | None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not is_int(value):
        raise type_error(key, "an integer", value)
    _check_range(key, value, lo, hi)
    return value


def float_field(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise type_error(key, "a decimal", value)
    _check_range(key, value, lo, hi)
    return float(value)


def bool_field(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, bool):
        raise type_error(key, "a boolean", value)
    return value


def _check_range(key: str, value: float, lo: float | None, hi: float | None) -> None:
    if lo is not None and value < lo:
        raise fail(
            ErrorCode.INVALID_VALUE,
            f"Invalid '{key}': {value} is below the minimum; expected a value >= {lo}.",
            key,
        )
    if hi is not None and value > hi:
        raise fail(
            ErrorCode.INVALID_VALUE,
            f"Invalid '{key}': {value} is above the maximum; expected a value <= {hi}.",
            key,
        )


def is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def temperature_top_p(body: dict[str, Any]) -> tuple[float | None, float | None]:
    temperature = float_field(body, "temperature", 0.0, 2.0)
    top_p = float_field(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise fail(ErrorCode.INVALID_VALUE, "Invalid 'top_p': expected a value > 0.", "top_p")
    return temperature, top_p


def stops(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        items = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        items = stop
    else:
        raise type_error("stop", "a string or an array of strings", stop)
    if len(items) > MAX_STOPS:
        raise fail(
            ErrorCode.INVALID_VALUE,
            f"Invalid 'stop': at most {MAX_STOPS} stop sequences are allowed, got {len(items)}.",
            "stop",
        )
    if any(not s for s in items):
        raise fail(
            ErrorCode.INVALID_VALUE, "Invalid 'stop': stop sequences must not be empty.", "stop"
        )
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise fail(
            ErrorCode.INVALID_VALUE,
            f"Invalid 'stop': a stop sequence may be at most {MAX_STOP_CHARS} characters long.",
            "stop",
        )
    return tuple(items)


def token_id_problem(ids: Any) -> str | None:
    """Why a list of token ids cannot be run whatever the model (a negative id, or one past
    int32), or None. The model's own vocabulary is checked where the model is known."""
    for t in ids:
        if t < 0:
            return "token ids must be >= 0"
        if t > MAX_TOKEN_ID:
            return f"token id {t} is out of range (token ids fit in 32 bits)"
    return None


@dataclass(frozen=True, slots=True)
class SamplingFields:
    """The sampling parameters chat and completions share, as the body gives them."""

    temperature: float | None
    top_p: float | None
    seed: int | None
    n: int
    stop: tuple[str, ...]

    @classmethod
    def read(cls, body: dict[str, Any]) -> SamplingFields:
        """Judged in this order: the first bad one is the error."""
        temperature, top_p = temperature_top_p(body)
        seed = int_field(body, "seed", None, None)
        n = int_field(body, "n", 1, MAX_N) or 1
        return cls(temperature, top_p, seed, n, stops(body))

    def params(self, max_tokens: int | None, logprobs: bool, top_logprobs: int) -> SamplingParams:
        return sampling_params(
            max_tokens, self.temperature, self.top_p, seed=self.seed, stop=self.stop,
            logprobs=logprobs, top_logprobs=top_logprobs,
        )  # fmt: skip


# Parameters chat and completions both take and honour (or harmlessly ignore, like `user`).
COMMON_KEYS = frozenset(
    {
        "model", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "logprobs", "stream",
        "stream_options", "user", "frequency_penalty", "presence_penalty", "logit_bias",
        "service_tier", "safety_identifier", "prompt_cache_key",
    }
)  # fmt: skip
# Real OpenAI parameters batchmlx cannot serve: a 400 unsupported_value when set.
_UNSUPPORTED = frozenset(
    {
        "tools", "tool_choice", "functions", "function_call", "reasoning_effort", "modalities",
        "audio", "prediction", "web_search_options", "verbosity",
    }
)  # fmt: skip


def check_keys(body: dict[str, Any], allowed: frozenset[str]) -> None:
    """Chat and completions: every key is one `allowed`, or an unsupported one left null."""
    for key, value in body.items():
        if key in allowed:
            continue
        if key in _UNSUPPORTED:
            if value is None:
                continue
            raise unsupported(key, "batchmlx does not support tools or this feature.")
        raise fail(
            ErrorCode.UNKNOWN_PARAMETER, f"Unrecognized request argument supplied: {key}", key
        )


def check_no_ops(body: dict[str, Any]) -> None:
    """Chat and completions: parameters accepted only at their no-op values."""
    if body.get("stream") is not None:
        if bool_field(body, "stream"):
            raise unsupported("stream", "batch requests cannot stream.")
    for key in ("frequency_penalty", "presence_penalty"):
        if float_field(body, key, -2.0, 2.0):
            raise unsupported(key, "only 0 is supported.")
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict):
            raise type_error("logit_bias", "an object", bias)
        if bias:
            raise unsupported("logit_bias", "logit_bias is not supported.")
    for key in ("user", "service_tier", "safety_identifier", "prompt_cache_key"):
        value = body.get(key)
        if value is not None and not isinstance(value, str):
            raise type_error(key, "a string", value)
    for key in ("metadata", "stream_options"):
        value = body.get(key)
        if value is not None and not isinstance(value, dict):
            raise type_error(key, "an object", value)
    bool_field(body, "store")
    bool_field(body, "parallel_tool_calls")


def grammar_field(read: Callable[[Any], Grammar | None], fmt: Any) -> Grammar | None:
    """A structured-output format through `formats.structured`, its FormatError a 400."""
    try:
        return read(fmt)
    except FormatError as exc:
        raise fail(exc.code, exc.message, exc.param) from None


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


def template_role(role: Any, at: str) -> str:
    """The template role of a message's role, which must be one a chat template takes (chat
    messages, response items)."""
    if not isinstance(role, str) or role not in TEMPLATE_ROLE:
        raise fail(
            ErrorCode.INVALID_VALUE,
            f"Invalid value for '{at}.role': {role!r}. Supported values are: "
            "'system', 'developer', 'user' and 'assistant'.",
            f"{at}.role",
        )
    return TEMPLATE_ROLE[Role(role)]


# a media part's reader (formats.media's): (part, its param, message index) → its MediaPart
MediaReader = Callable[[dict[str, Any], str, int], MediaPart]


def content_text(
    content: Any,
    param: str,
    kinds: tuple[str, ...],
    refuse: Callable[[str], Reject],
    media: tuple[Mapping[str, MediaReader], int, list[MediaPart]] | None = None,
) -> str:
    """A message's content (a string, or text parts of one of `kinds`) as one string; `refuse`
    makes the error of a part of another kind (audio, say), given its `type` param. `media`:
    (readers by part type, the message's index, the list each read part is appended to)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise type_error(param, "a string or an array of content parts", content)
    readers: Mapping[str, MediaReader] = {}
    message = 0
    found: list[MediaPart] = []
    if media is not None:
        readers, message, found = media
    texts: list[str] = []
    for j, part in enumerate(content):
        at = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise type_error(at, "an object", part)
        reader = readers.get(str(part.get("type")))
        if reader is not None:
            found.append(reader(part, at, message))
            continue
        if part.get("type") not in kinds:
            raise refuse(f"{at}.type")
        text = part.get("text")
        if not isinstance(text, str):
            raise type_error(f"{at}.text", "a string", text)
        texts.append(text)
    return "\n".join(texts)  # the parts of one message, a line each (vLLM does the same)


class InputShape(enum.Enum):
    """The shapes a completions prompt or an embeddings input may take (OpenAI's four)."""

    TEXT = "a string"
    TEXTS = "an array of strings"
    IDS = "an array of token ids"
    ID_LISTS = "an array of token-id arrays"


def input_shape(value: Any) -> InputShape | None:
    """The shape of a prompt or embeddings `input`; None for anything else. A file whose line
    has None fails whole (formats.validate)."""
    if isinstance(value, str):
        return InputShape.TEXT
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(v, str) for v in value):
        return InputShape.TEXTS
    if all(is_int(v) for v in value):
        return InputShape.IDS
    if all(isinstance(v, list) and v and all(is_int(t) for t in v) for v in value):
        return InputShape.ID_LISTS
    return None
