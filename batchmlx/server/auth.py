"""Access control: a bearer key on every request, and no open port on a non-loopback address."""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from batchmlx.server.errors import envelope

API_KEY_ENV = "BATCHMLX_API_KEY"


class RemoteBindError(Exception):
    pass


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: cannot tell, so treat it as remote


def check_bind(host: str, api_key: str | None, allow_remote: bool) -> None:
    """Refuse an unauthenticated server reachable from other machines unless asked for."""
    if api_key or allow_remote or is_loopback(host):
        return
    raise RemoteBindError(
        f"refusing to serve on {host} without an API key: anyone who can reach it could run "
        f"requests and read your files. Set --api-key (or ${API_KEY_ENV}), or pass "
        "--allow-remote to do it anyway."
    )


def bearer_token(header: bytes) -> bytes | None:
    """The credentials of `Authorization: Bearer <token>`; the scheme is case-insensitive
    (RFC 7235), so `bearer KEY` works as it does with OpenAI."""
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip()


class BearerAuth:
    """ASGI middleware: 401 with OpenAI's envelope unless `Authorization: Bearer <key>`."""

    def __init__(
        self, app: ASGIApp, api_key: str, public: Callable[[str], bool] = lambda path: False
    ) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.public = public  # paths that hold no data (the dashboard page's own files)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.public(scope["path"]):
            await self.app(scope, receive, send)
            return
        got = dict(scope["headers"]).get(b"authorization", b"")
        token = bearer_token(got)
        if token is not None and hmac.compare_digest(token, self.expected):
            await self.app(scope, receive, send)
            return
        from starlette.responses import JSONResponse

        message = (
            "Incorrect API key provided." if got else
            "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY'."
        )  # fmt: skip
        body = envelope(message, "invalid_request_error", None, "invalid_api_key")
        await JSONResponse(body, 401)(scope, receive, send)
