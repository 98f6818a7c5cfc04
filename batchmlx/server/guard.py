"""Web pages the user visits must not drive this server, key or no key.

DNS rebinding: a page on attacker.example whose name then resolves to 127.0.0.1 reaches the
server with `Host: attacker.example`; only names the server answers to pass. Cross-site
requests: any page may send simple (form, text) requests to any address without asking first;
a request whose `Origin` is not the server's own is refused, and JSON bodies must say
application/json (bodies.json_body), which no page can send elsewhere without a preflight.
Same-origin pages (a dashboard served here) and clients that send no Origin are unaffected.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from batchmlx.server.auth import is_loopback
from batchmlx.server.errors import ApiError, error_response

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def host_name(netloc: str) -> str | None:
    """'Example.org:8000' → 'example.org', '[::1]:8000' → '::1'; None when malformed."""
    if "@" in netloc:
        return None  # urlsplit would drop 'a.example@' and answer for what follows it
    try:
        parts = urlsplit(f"//{netloc}")
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        return None
    return parts.hostname


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class HostPolicy:
    names: frozenset[str]  # names a Host header may carry (lowercase, no port)
    extra: frozenset[str]  # of those, the ones the user added (--allowed-host): proxies
    any_host: bool  # bound for remote clients with a key: the key guards, not the name

    @classmethod
    def for_bind(cls, bind_host: str, *, api_key: str | None, extra: Iterable[str]) -> HostPolicy:
        added = frozenset(n for n in map(host_name, extra) if n)
        bound = host_name(bind_host) or bind_host
        names = LOOPBACK_NAMES | {bound} | added
        return cls(names, added, any_host=bool(api_key) and not is_loopback(bind_host))

    def allows_host(self, name: str) -> bool:
        # an address is safe to accept: rebinding needs a name its attacker controls
        return self.any_host or name in self.names or _is_ip(name)

    def allows_origin(self, origin: str, host: str) -> bool:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https"):
            return False  # "null": sandboxed frames, file:// pages
        return parts.netloc.lower() == host.lower() or parts.hostname in self.extra


class RequestGuard:
    """ASGI middleware: 400 for a Host the server does not answer to, 403 for a foreign
    Origin, both in OpenAI's envelope."""

    def __init__(self, app: ASGIApp, policy: HostPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1")
        origin = headers.get(b"origin", b"").decode("latin-1")
        err = self._refusal(host, origin)
        if err is None:
            await self.app(scope, receive, send)
            return
        response: JSONResponse = error_response(err)
        await response(scope, receive, send)

    def _refusal(self, host: str, origin: str) -> ApiError | None:
        name = host_name(host) if host else None
        if host and (name is None or not self.policy.allows_host(name)):
            return ApiError(400, f"Invalid Host header {host!r}: this server answers to "
                            f"{', '.join(sorted(self.policy.names))}; add a name with "
                            "--allowed-host.", code="invalid_host")  # fmt: skip
        if origin and not self.policy.allows_origin(origin, host):
            return ApiError(403, f"Requests from web pages of another origin ({origin}) are "
                            "refused.", code="forbidden_origin")  # fmt: skip
        return None
