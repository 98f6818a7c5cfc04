"""/v1/batches: create (answered `validating`, validated afterwards), retrieve, cancel, list."""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from batchmlx.batches.errors import BatchError, CannotCancel
from batchmlx.batches.intake import create_batch
from batchmlx.batches.lifecycle import cancel_unattended, expire_unattended
from batchmlx.batches.windows import OPENAI_COMPLETION_WINDOW
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.records import BatchRecord
from batchmlx.formats.batch_request import CreateProblem, endpoint_problem, metadata_problem
from batchmlx.formats.expiry import ExpiresAfterError, parse_expires_after
from batchmlx.formats.openai import batch_object
from batchmlx.server.bodies import json_body
from batchmlx.server.context import ServerContext
from batchmlx.server.errors import ApiError, not_found
from batchmlx.server.pages import page_params, page_response


def _required_str(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if value is None:
        raise ApiError(400, f"Missing required parameter: '{key}'.",
                       code="missing_required_parameter", param=key)  # fmt: skip
    if not isinstance(value, str):
        raise ApiError(400, f"Invalid type for '{key}': expected a string.",
                       code="invalid_type", param=key)  # fmt: skip
    return value


def _refuse(problem: CreateProblem | None) -> None:
    if problem is not None:
        raise ApiError(400, problem.message, code=problem.code.value, param=problem.param)


def _respond(rec: BatchRecord) -> JSONResponse:
    return JSONResponse(batch_object(rec))


async def create(request: Request) -> JSONResponse:
    ctx: ServerContext = request.app.state.ctx
    body = await json_body(request)
    input_file_id = _required_str(body, "input_file_id")
    endpoint = _required_str(body, "endpoint")
    _refuse(endpoint_problem(endpoint))
    window = _required_str(body, "completion_window")
    if window != OPENAI_COMPLETION_WINDOW:
        raise ApiError(400, f"Invalid value for 'completion_window': {window!r}. Supported "
                       f"values are: '{OPENAI_COMPLETION_WINDOW}'.",
                       code="invalid_value", param="completion_window")  # fmt: skip
    metadata = body.get("metadata")
    _refuse(metadata_problem(metadata))
    try:
        output_expires_after = parse_expires_after(
            body.get("output_expires_after"), "output_expires_after"
        )
    except ExpiresAfterError as exc:
        raise ApiError(400, str(exc), code="invalid_value", param=exc.param) from None
    # an input file that does not exist is not refused here: as OpenAI does, the batch is
    # created and fails validation ("Cannot find file ...")
    try:
        rec = await create_batch(
            ctx.store, ctx.settings, input_file_id=input_file_id, endpoint=endpoint,
            now=time.time(), completion_window=window, metadata=metadata or None,
            output_expires_after=output_expires_after,
        )  # fmt: skip
    except BatchError as exc:  # an input file whose purpose is not 'batch'
        raise ApiError(400, str(exc), code="invalid_value", param="input_file_id") from None
    ctx.validator.wake.set()
    return _respond(rec)


async def _batch(ctx: ServerContext, batch_id: str) -> BatchRecord:
    rec = await ctx.store.get_batch(batch_id)
    if rec is None:
        raise not_found("batch", batch_id)
    return rec


async def retrieve(request: Request) -> JSONResponse:
    ctx: ServerContext = request.app.state.ctx
    rec = await _batch(ctx, request.path_params["batch_id"])
    if not ctx.worker_alive:
        rec = await expire_unattended(
            ctx.store, ctx.settings, rec, now=time.time(), hooks=ctx.finalize_hooks
        )
    return _respond(rec)


async def cancel(request: Request) -> JSONResponse:
    ctx: ServerContext = request.app.state.ctx
    batch_id = request.path_params["batch_id"]
    rec = await _batch(ctx, batch_id)
    if rec.status is BatchStatus.VALIDATING:
        # the lifecycle has no validating → cancelling move: finish validating it first
        await ctx.validator.validate(batch_id)
    try:
        rec = await cancel_unattended(
            ctx.store,
            ctx.settings,
            batch_id,
            now=time.time(),
            worker_alive=ctx.worker_alive,
            hooks=ctx.finalize_hooks,
        )
    except CannotCancel as exc:  # OpenAI's 409, with no code
        raise ApiError(409, str(exc)) from None
    return _respond(rec)


async def list_batches(request: Request) -> JSONResponse:
    ctx: ServerContext = request.app.state.ctx
    limit, after, _ = page_params(request, default_limit=20, max_limit=100)
    recs = await ctx.store.list_batches(limit=limit + 1, after=after)
    return page_response([batch_object(r) for r in recs], limit)


ROUTES = [
    Route("/v1/batches", create, methods=["POST"]),
    Route("/v1/batches", list_batches, methods=["GET"]),
    Route("/v1/batches/{batch_id}", retrieve, methods=["GET"]),
    Route("/v1/batches/{batch_id}/cancel", cancel, methods=["POST"]),
]
