"""OpenAI's error envelope: `{"error": {"message", "type", "param", "code"}}` with its status."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

from batchmlx.store import StoreUnavailable
from batchmlx.store.errors import is_transient_db_error, unwrapped_driver_errors

log = logging.getLogger("batchmlx.server")

STORE_RETRY_AFTER_S = 1  # a busy database usually frees up within the client's next try


class ApiError(Exception):
    """Raised by a handler; answered as the envelope with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or ("server_error" if status >= 500 else "invalid_request_error")


def envelope(message: str, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: ApiError, headers: dict[str, str] | None = None) -> JSONResponse:
    body = envelope(err.message, err.type, err.param, err.code)
    return JSONResponse(body, err.status, headers=headers)


def not_found(kind: str, ident: str) -> ApiError:
    return ApiError(404, f"No {kind} found with id '{ident}'.", code="not_found")


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = (
        f"Invalid URL ({request.method} {request.url.path})"
        if exc.status_code in (404, 405)
        else str(exc.detail)
    )
    return error_response(ApiError(exc.status_code, msg, code=code))


def database_unavailable() -> JSONResponse:
    err = ApiError(503, "The database is busy or unavailable; retry the request shortly.",
                   code="database_unavailable")  # fmt: skip
    return error_response(err, {"Retry-After": str(STORE_RETRY_AFTER_S)})


async def _store_error(request: Request, exc: Exception) -> JSONResponse:
    # SQLite's "database is locked" after the busy timeout, PostgreSQL down or restarting, a
    # pool with no connection left, a full disk: the request may well succeed later, so 503
    # (which clients retry), not 500. Any other database error is a bug: re-raised, it is
    # answered by _unexpected, and the server logs its traceback.
    if not is_transient_db_error(exc):
        raise exc
    log.warning("%s %s: the database is unavailable: %s", request.method, request.url.path,
                getattr(exc, "orig", None) or exc)  # fmt: skip
    return database_unavailable()


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises after this answer, so the server logs the traceback
    err = ApiError(500, "The server had an error while processing your request.",
                   code="server_error")  # fmt: skip
    return error_response(err)


EXCEPTION_HANDLERS = {
    ApiError: _api_error,
    HTTPException: _http_error,
    # every route, whatever the driver raises: SQLAlchemy's errors, asyncpg's refused
    # connect (an OSError), the store's own
    SQLAlchemyError: _store_error,
    StoreUnavailable: _store_error,
    ConnectionError: _store_error,
    TimeoutError: _store_error,
    **dict.fromkeys(unwrapped_driver_errors(), _store_error),
    Exception: _unexpected,  # last resort: OpenAI's envelope, never a bare text page
}
