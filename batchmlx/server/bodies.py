"""Request bodies read within a bound: JSON bodies (media type checked) and the counting
`receive` that multipart uploads are parsed through; and the JSON response of large bodies."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Message, Receive

from batchmlx.server.errors import ApiError

JSON_MEDIA_TYPE = "application/json"


class FastJSONResponse(JSONResponse):
    """A JSON response encoded by orjson. The encoding runs on the event loop: 2,048 embeddings
    of 576 floats take starlette's json.dumps 705 ms (every other route waited; issue 21's load
    test) and orjson 43 ms."""

    def render(self, content: Any) -> bytes:
        # numpy scalars and arrays as starlette's encoder takes float64 (a float subclass)
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


class BodyTooLarge(Exception):
    pass


def bounded(receive: Receive, limit: int) -> Receive:
    """Count body bytes as they arrive (covers bodies without a Content-Length)."""
    seen = 0

    async def wrapped() -> Message:
        nonlocal seen
        message = await receive()
        if message["type"] == "http.request":
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge
        return message

    return wrapped


def declared_length(request: Request) -> int | None:
    """Content-Length as a number; None when absent (h11 has already refused a malformed one)."""
    value = request.headers.get("content-length", "")
    return int(value) if value.isascii() and value.isdigit() else None


def media_type(request: Request) -> str:
    return request.headers.get("content-type", "").partition(";")[0].strip().lower()


def _json_too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than the server's limit of {limit} bytes.",
                    code="request_too_large")  # fmt: skip


async def json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object: `application/json` only (a browser cannot send that to
    another origin without asking first), at most `max_json_bytes`, never buffered past it."""
    if media_type(request) != JSON_MEDIA_TYPE:
        raise ApiError(415, f"Unsupported Content-Type; send the body as {JSON_MEDIA_TYPE}.",
                       code="unsupported_media_type")  # fmt: skip
    limit = request.app.state.ctx.options.max_json_bytes
    length = declared_length(request)
    if length is not None and length > limit:
        raise _json_too_large(limit)
    try:
        raw = await Request(request.scope, bounded(request.receive, limit)).body()
    except BodyTooLarge:
        raise _json_too_large(limit) from None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"The body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The body must be a JSON object.", code="invalid_type")
    return body
