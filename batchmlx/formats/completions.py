"""/v1/completions (the legacy text endpoint): a body's shape (file validation), the body →
`ParsedRequest` (or OpenAI's 400) at run time, and the text_completion object.

A prompt is one of `fields.InputShape`'s four shapes, or the file fails whole; a list of several
prompts is well-formed but refused per request (one prompt per request is served).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Unpack

from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.fields import (
    COMMON_KEYS,
    REQUIRED,
    InputShape,
    SamplingFields,
    bool_field,
    check_keys,
    check_no_ops,
    fail,
    input_shape,
    int_field,
    type_error,
    unsupported,
)
from batchmlx.formats.openai import (
    ChoiceResult,
    Envelope,
    TokenLogprobText,
    clamp_logprob,
    completion_object,
    finish_value,
)
from batchmlx.formats.request import Endpoint, ParsedRequest

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_COMPLETION_LOGPROBS = 5
_KEYS = COMMON_KEYS | {"prompt", "echo", "best_of", "suffix"}


def check_prompt(body: dict[str, Any]) -> tuple[str, str] | None:
    """The file-validation shape check: (param, problem) or None."""
    prompt = body.get("prompt")
    if prompt is None:
        return "body.prompt", REQUIRED
    # One prompt per request is served; a longer list is refused at run time, not here.
    if input_shape(prompt) is None:
        return "body.prompt", "must be a string, an array of strings or an array of token ids"
    return None


def _prompt(body: dict[str, Any]) -> tuple[str | None, tuple[int, ...] | None]:
    prompt = body.get("prompt")
    if prompt is None:
        raise fail(
            ErrorCode.MISSING_REQUIRED_PARAMETER, "Missing required parameter: 'prompt'.", "prompt"
        )
    shape = input_shape(prompt)
    if shape is InputShape.TEXT:
        return prompt, None
    if shape is InputShape.IDS:
        # ids past the vocabulary (int32's range included) are refused where the model is
        # known, naming its vocabulary (worker/translate)
        if any(t < 0 for t in prompt):
            raise fail(
                ErrorCode.INVALID_VALUE, "Invalid 'prompt': token ids must be >= 0.", "prompt"
            )
        return None, tuple(prompt)
    # one-element lists of the other shapes are read as their element; at run time (online, with
    # no file check before) a few malformed lists are read by their first element too
    expected = "a string, an array of strings or an array of token ids"
    if not isinstance(prompt, list):
        raise type_error("prompt", expected, prompt)
    if not prompt:
        raise fail(
            ErrorCode.INVALID_VALUE, "Invalid 'prompt': expected a non-empty array.", "prompt"
        )
    if len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise unsupported("prompt", "one prompt per request is supported; send one line each.")
    only = prompt[0]
    if isinstance(only, str):
        return only, None
    if isinstance(only, list) and only:
        return _prompt({"prompt": only})
    raise type_error("prompt", expected, prompt)


def parse_completions(body: dict[str, Any]) -> ParsedRequest:
    """Raises `fields.Reject` (params.parse_request turns it into the RequestError)."""
    check_keys(body, _KEYS)
    check_no_ops(body)
    prompt, token_ids = _prompt(body)
    max_tokens = int_field(body, "max_tokens", 1, None)
    if max_tokens is None:
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    fields = SamplingFields.read(body)
    level = int_field(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    logprobs, top_logprobs = level is not None, level or 0
    echo = bool(bool_field(body, "echo"))
    best_of = int_field(body, "best_of", 1, None)
    if best_of is not None and best_of != fields.n:
        raise unsupported("best_of", "best_of must equal n.")
    suffix = body.get("suffix")
    if suffix is not None and not isinstance(suffix, str):
        raise type_error("suffix", "a string", suffix)
    if suffix:
        raise unsupported("suffix", "suffix (insertion) is not supported.")
    return ParsedRequest(
        endpoint=Endpoint.COMPLETIONS,
        prompt=prompt,
        prompt_token_ids=token_ids,
        n=fields.n,
        sampling=fields.params(max_tokens, logprobs, top_logprobs),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        echo=echo,
    )


def _legacy_logprobs(tokens: list[TokenLogprobText] | None, offset: int) -> dict[str, Any] | None:
    """The legacy completions format: parallel arrays, alternatives as {token: logprob}."""
    if tokens is None:
        return None
    offsets: list[int] = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.token)
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [clamp_logprob(t.logprob) for t in tokens],
        "top_logprobs": [{tok: clamp_logprob(lp) for tok, lp, _ in t.top} for t in tokens],
        "text_offset": offsets,
    }


def text_completion_body(
    *, choices: Sequence[ChoiceResult], text_offset: int = 0, **envelope: Unpack[Envelope]
) -> dict[str, Any]:
    """A `text_completion` object (openai.types.Completion).

    `text_offset` is where the first logprob token starts in the text OpenAI counts from: the
    prompt's length in characters without echo, 0 with echo.
    """
    rendered = [
        {
            "index": c.index,
            "text": c.text,
            "logprobs": _legacy_logprobs(c.logprobs, text_offset),
            "finish_reason": finish_value(c.finish_reason),
        }
        for c in choices
    ]
    return completion_object("text_completion", rendered, **envelope)
