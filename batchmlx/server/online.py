"""Online /v1/chat/completions and /v1/completions on the worker's engine, ahead of batch work,
and `stream: true` as server-sent events in OpenAI's chunk format."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from batchmlx.core.model_rule import Refused, choose_model, served_hint
from batchmlx.formats.chunks import StreamChunks
from batchmlx.formats.params import parse_request
from batchmlx.formats.request import Endpoint, ParsedRequest, RequestError
from batchmlx.server.bodies import FastJSONResponse, json_body
from batchmlx.server.context import ServerContext
from batchmlx.server.errors import ApiError
from batchmlx.server.streaming import ChoiceStream

# Streaming is the server's business; the engine sees a plain request.
_STREAM_KEYS = ("stream", "stream_options")
_NO_STREAM = (Endpoint.RESPONSES, Endpoint.EMBEDDINGS)


def _sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _final_text(body: dict[str, Any], index: int, chat: bool) -> tuple[str, str]:
    c = body["choices"][index]
    return (c["message"]["content"] if chat else c["text"]), c["finish_reason"]


def _echo_prefix(parsed: ParsedRequest, decode) -> str:
    if not parsed.echo:
        return ""
    if parsed.prompt is not None:
        return parsed.prompt
    return decode(list(parsed.prompt_token_ids or ()))


async def _stream(
    ctx: ServerContext, ticket, parsed: ParsedRequest, first, include_usage: bool
) -> AsyncIterator[bytes]:
    from batchmlx.worker.online import DoneEvent

    chunks = StreamChunks(parsed.endpoint, ticket.model or ctx.model_name, created=int(time.time()))
    interval = ctx.options.stream_interval
    prefix = _echo_prefix(parsed, ticket.decode)
    streams = [ChoiceStream(ticket.decode, parsed.sampling.stop, prefix) for _ in range(parsed.n)]
    done = False
    try:
        if chunks.chat:
            for i in range(parsed.n):
                yield _sse(chunks.text(i, "", role=True))
        event = first
        while True:
            if isinstance(event, DoneEvent):
                done = True
                break
            s = streams[event.choice]
            s.add(event.token_id)
            if s.unsent >= interval:
                delta = s.flush()
                if delta:
                    yield _sse(chunks.text(event.choice, delta))
            event = await ticket.events.get()
        if event.status_code != 200:
            yield _sse(event.body)  # an engine error after the stream began
        else:
            for i, s in enumerate(streams):
                text, finish = _final_text(event.body, i, chunks.chat)
                delta = s.finish(text)
                if delta:
                    yield _sse(chunks.text(i, delta))
                yield _sse(chunks.text(i, "", finish=finish))
            if include_usage:
                yield _sse(chunks.usage(event.body["usage"]))
        yield b"data: [DONE]\n\n"
    finally:
        if not done:
            ctx.worker.online.cancel(ticket)  # the client went away


def _type_error(param: str, expected: str) -> ApiError:
    return ApiError(400, f"Invalid type for '{param}': expected {expected}.",
                    code="invalid_type", param=param)  # fmt: skip


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage), booleans as OpenAI requires: `1 == True` in Python, so an
    `in (True, False)` test would take `stream: 1` for a stream."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _type_error("stream", "a boolean")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _type_error("stream_options", "an object")
    usage = (opts or {}).get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise _type_error("stream_options.include_usage", "a boolean")
    return stream is True, stream is True and usage is True


def _check_model(ctx: ServerContext, name: object) -> None:
    """The batches' model rule (core/model_rule.py) for an online request: a name this server
    does not answer (--strict-models) is OpenAI's 404 `model_not_found`."""
    if not isinstance(name, str):
        return  # the body's own checks judge a missing or malformed model
    choice = choose_model(name, ctx.validator.rule, hub_problem=lambda _: None)  # serve: pinned
    if isinstance(choice, Refused):
        raise ApiError(404, f"The model `{name}` does not exist or you do not have access to it. "
                       f"{served_hint(ctx.validator.rule)}", code="model_not_found")  # fmt: skip


async def _complete(request: Request, endpoint: Endpoint) -> Response:
    ctx: ServerContext = request.app.state.ctx
    body = await json_body(request)
    stream, include_usage = _stream_flags(body)
    engine_body = {k: v for k, v in body.items() if k not in _STREAM_KEYS}
    if stream and endpoint in _NO_STREAM:
        raise ApiError(400, "Unsupported parameter: 'stream' is not supported with this model.",
                       code="unsupported_parameter", param="stream")  # fmt: skip
    # embeddings bodies are judged by the worker (formats.embeddings), like in a batch
    parsed = None if endpoint is Endpoint.EMBEDDINGS else parse_request(endpoint.value, engine_body)
    if isinstance(parsed, RequestError):
        return JSONResponse(parsed.body(), parsed.status_code)
    _check_model(ctx, body.get("model"))
    if not ctx.worker_alive:
        raise ApiError(503, "This server runs no worker (--no-worker): online requests need "
                       "one.", code="no_worker")  # fmt: skip
    ticket = ctx.worker.online.submit(endpoint.value, engine_body, time.time())
    try:
        first = await ticket.events.get()
    except asyncio.CancelledError:
        ctx.worker.online.cancel(ticket)
        raise
    from batchmlx.worker.online import DoneEvent

    if isinstance(first, DoneEvent) and (first.status_code != 200 or not stream):
        return FastJSONResponse(first.body, first.status_code)
    if not stream:
        try:
            while not isinstance(event := await ticket.events.get(), DoneEvent):
                pass
        except asyncio.CancelledError:
            ctx.worker.online.cancel(ticket)
            raise
        return FastJSONResponse(event.body, event.status_code)
    assert parsed is not None  # embeddings never stream (_NO_STREAM)
    return StreamingResponse(
        _stream(ctx, ticket, parsed, first, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def chat_completions(request: Request) -> Response:
    return await _complete(request, Endpoint.CHAT)


async def completions(request: Request) -> Response:
    return await _complete(request, Endpoint.COMPLETIONS)


async def responses(request: Request) -> Response:
    return await _complete(request, Endpoint.RESPONSES)


async def embeddings(request: Request) -> Response:
    return await _complete(request, Endpoint.EMBEDDINGS)


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/responses", responses, methods=["POST"]),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
]
