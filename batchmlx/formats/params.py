"""One request body → what the engine needs (`ParsedRequest`), or the 400 OpenAI would answer:
the run-time entry, which hands the body to its endpoint's module (chat, completions, responses).

Validation (`formats.validate`) only checks a file's shape; the values are judged here, per
request, so one odd line fails alone with a 400 in the error file instead of failing the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batchmlx.formats.chat import parse_chat
from batchmlx.formats.completions import parse_completions
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.fields import Reject
from batchmlx.formats.request import Endpoint, ParsedRequest, RequestError
from batchmlx.formats.responses import parse_responses

_PARSERS: dict[Endpoint, Callable[[dict[str, Any]], ParsedRequest]] = {
    Endpoint.CHAT: parse_chat,
    Endpoint.COMPLETIONS: parse_completions,
    Endpoint.RESPONSES: parse_responses,
}


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
        return _PARSERS[ep](body)
    except Reject as reject:
        return reject.error
