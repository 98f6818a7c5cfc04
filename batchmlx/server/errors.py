"""OpenAI's error envelope: `{"error": {"message", "type", "param", "code"}}` with its status."""

from __future__ import annotations

from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "server_error",
}


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
        fallback = "server_error" if status >= 500 else "invalid_request_error"
        self.type = type or _TYPES.get(status, fallback)


def envelope(message: str, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(envelope(err.message, err.type, err.param, err.code), err.status)


def not_found(kind: str, ident: str) -> ApiError:
    return ApiError(404, f"No {kind} found with id '{ident}'.", code="not_found")


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    msg = f"Invalid URL ({request.method} {request.url.path})" if exc.status_code in (404, 405) \
        else str(exc.detail)
    return error_response(ApiError(exc.status_code, msg, code=code))


EXCEPTION_HANDLERS = {ApiError: _api_error, HTTPException: _http_error}
