"""/v1/files: upload (multipart, bounded), list with cursor pagination, retrieve, content, delete.

Output and error files of batches are files too, with purpose `batch_output`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from batchmlx.batches.files import CHUNK_BYTES, delete_file, store_file
from batchmlx.core.records import FileRecord
from batchmlx.formats.expiry import ExpiresAfterError, parse_expires_after
from batchmlx.formats.openai import file_deleted_object, file_object
from batchmlx.server.bodies import BodyTooLarge, bounded, declared_length, media_type
from batchmlx.server.context import ServerContext
from batchmlx.server.errors import ApiError, not_found
from batchmlx.server.pages import page_params, page_response

UPLOAD_PURPOSES = ("batch",)
LIST_LIMIT_MAX = 10_000


def _too_large(limit: int) -> ApiError:
    return ApiError(
        413,
        f"The upload is larger than the server's limit of {limit} bytes "
        f"({limit // (1024 * 1024)} MB).",
        code="file_too_large",
        param="file",
    )


async def upload(request: Request) -> JSONResponse:
    ctx: ServerContext = request.app.state.ctx
    limit = ctx.options.max_upload_bytes
    length = declared_length(request)
    if length is not None and length > limit + 64 * 1024:
        raise _too_large(limit)  # room for the multipart framing around the file
    if media_type(request) != "multipart/form-data":
        raise ApiError(415, "Expected a multipart/form-data body with 'file' and 'purpose'.",
                       code="unsupported_media_type")  # fmt: skip
    within = Request(request.scope, bounded(request.receive, limit + 64 * 1024))
    try:
        async with within.form(max_files=1, max_fields=8) as form:
            purpose = form.get("purpose")
            upload = form.get("file")
            if not isinstance(purpose, str) or not purpose:
                raise ApiError(400, "Missing required parameter: 'purpose'.",
                               code="missing_required_parameter", param="purpose")  # fmt: skip
            if purpose not in UPLOAD_PURPOSES:
                raise ApiError(400, f"Invalid value for 'purpose': {purpose!r}. batchmlx stores "
                               "files for the Batch API: use 'batch'.", code="invalid_value",
                               param="purpose")  # fmt: skip
            if upload is None or isinstance(upload, str):
                raise ApiError(400, "Missing required parameter: 'file' (a file part).",
                               code="missing_required_parameter", param="file")  # fmt: skip
            expires_after = _expires_after(form)
            if upload.size is not None and upload.size > limit:
                raise _too_large(limit)
            # the parser spooled the part to a temporary file: stored from there in chunks,
            # so a 200 MB upload is never whole in memory
            rec = await store_file(
                ctx.store, ctx.settings, _chunks(upload), filename=upload.filename or
                "upload.jsonl", purpose=purpose, now=time.time(), expires_after=expires_after,
            )  # fmt: skip
    except BodyTooLarge:
        raise _too_large(limit) from None
    except (HTTPException, MultiPartException) as exc:  # starlette's word for a malformed body
        detail = getattr(exc, "detail", None) or getattr(exc, "message", str(exc))
        raise ApiError(400, f"Malformed multipart body: {detail}", code="invalid_request") from None
    return JSONResponse(file_object(rec))


async def _chunks(upload: UploadFile) -> AsyncIterator[bytes]:
    await upload.seek(0)
    while chunk := await upload.read(CHUNK_BYTES):
        yield chunk


def _expires_after(form) -> int | None:
    """The SDK sends `expires_after` as the form fields expires_after[anchor] and [seconds]."""
    fields = {k: form.get(f"expires_after[{k}]") for k in ("anchor", "seconds")}
    if all(v is None for v in fields.values()):
        return None
    try:
        return parse_expires_after(fields, "expires_after")
    except ExpiresAfterError as exc:
        raise ApiError(400, str(exc), code="invalid_value", param=exc.param) from None


async def list_files(request: Request) -> JSONResponse:
    ctx: ServerContext = request.app.state.ctx
    limit, after, order = page_params(request, default_limit=LIST_LIMIT_MAX,
                                      max_limit=LIST_LIMIT_MAX, orders=True)  # fmt: skip
    purpose = request.query_params.get("purpose") or None
    recs = await ctx.store.list_files_page(
        purpose=purpose, limit=limit + 1, order=order, after=after
    )
    return page_response([file_object(r) for r in recs], limit)


async def _file(request: Request) -> FileRecord:
    ctx: ServerContext = request.app.state.ctx
    file_id = request.path_params["file_id"]
    rec = await ctx.store.get_file(file_id)
    if rec is None:
        raise not_found("file", file_id)
    return rec


async def retrieve(request: Request) -> JSONResponse:
    return JSONResponse(file_object(await _file(request)))


async def content(request: Request) -> Response:
    ctx: ServerContext = request.app.state.ctx
    rec = await _file(request)
    chunks = ctx.store.read_file(rec)
    try:  # the first chunk before any header: bytes gone are a 404 or a 410, never a 500
        first: bytes | None = await anext(chunks, b"")
    except FileNotFoundError:
        first = None
    if first is None or (not first and rec.bytes):
        await chunks.aclose()
        if await ctx.store.get_file(rec.id) is None:  # deleted since we looked it up
            raise not_found("file", rec.id)
        raise ApiError(410, f"The content of file '{rec.id}' is gone: its bytes are missing "
                       "from the data directory.", code="file_content_missing")  # fmt: skip

    head: bytes = first

    async def body() -> AsyncIterator[bytes]:
        yield head
        async for chunk in chunks:
            yield chunk

    # streamed: a 200 MB output file is never held whole; the length is the recorded size
    headers = {"content-length": str(rec.bytes)}
    return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)


async def delete(request: Request) -> JSONResponse:
    ctx: ServerContext = request.app.state.ctx
    file_id = request.path_params["file_id"]
    if not await delete_file(ctx.store, file_id):
        raise not_found("file", file_id)
    return JSONResponse(file_deleted_object(file_id))


ROUTES = [
    Route("/v1/files", upload, methods=["POST"]),
    Route("/v1/files", list_files, methods=["GET"]),
    Route("/v1/files/{file_id}", retrieve, methods=["GET"]),
    Route("/v1/files/{file_id}", delete, methods=["DELETE"]),
    Route("/v1/files/{file_id}/content", content, methods=["GET"]),
]
