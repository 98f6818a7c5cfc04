"""One https image or video fetched under bounds that a batch line cannot turn against the host.

- One deadline for the whole fetch (`FETCH_TIMEOUT_S`): connect, TLS handshake, request,
  headers and body of every hop. Each socket operation waits at most the time left, and the
  deadline is checked between reads, so a server that trickles a byte at a time still ends
  the fetch at the deadline (a per-read timeout alone would let it run for ever).
- Redirects are followed only to https URLs, at most `MAX_REDIRECTS` hops, within the same
  deadline.
- The host is resolved once and the fetch connects to that address (the TLS check still uses
  the host name), so a second DNS answer cannot switch it: loopback, private (RFC 1918,
  unique-local), link-local, multicast, unspecified and other non-global addresses are
  refused unless the operator allows them (config.MediaSettings.fetch_private).
- A refusal is a FetchRefused whose sentence names what was refused (never the address a
  private name resolved to, never the server's body).

Name resolution itself is bounded by the system resolver's own timeouts; the deadline is
checked as soon as it answers.
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urljoin, urlsplit

FETCH_TIMEOUT_S = 10.0  # the whole fetch of one https image, redirects included
MAX_REDIRECTS = 3  # hops followed (each to an https URL)
_REDIRECTS = (301, 302, 303, 307, 308)

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolve = Callable[[str, int], list[str]]  # host, port -> its addresses (resolved once)


class FetchRefused(Exception):
    """The fetch cannot go on; `str(exc)` is a sentence for the line's 400."""


class TooLarge(FetchRefused):
    """The answer is larger than the limit (its Content-Length says so; nothing was read)."""


class Cancelled(FetchRefused):
    """The request was cancelled (or the worker stops) while its fetch was under way."""


class Cancel:
    """Ends a fetch under way from another thread: sets the flag the fetch checks between reads
    and shuts the socket it waits on, so a blocked read returns at once."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        with self._lock:
            self._event.set()
            socks = list(self._socks)
        for s in socks:
            _shut(s)

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.add(sock)
            cancelled = self._event.is_set()
        if cancelled:
            _shut(sock)

    def forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.discard(sock)

    def check(self) -> None:
        if self._event.is_set():
            raise Cancelled("the request was cancelled while its media were fetched.")


def _shut(sock: socket.socket) -> None:
    try:  # the plain socket's shutdown (an SSLSocket's own would drop its TLS state under
        # the thread reading it): the blocked read sees the end of the stream
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def address_problem(ip: IP) -> str | None:
    """Why the fetch must not connect to `ip` (an article and a noun), or None: global."""
    if isinstance(ip, ipaddress.IPv6Address):  # an IPv4 address inside: judged as itself
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is not None:
            return address_problem(embedded)
    if ip.is_unspecified:
        return "an unspecified address"
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_multicast:
        return "a multicast address"
    if ip.is_private:
        return "a private address"
    if ip.is_reserved or not ip.is_global:
        return "a reserved, non-global address"
    return None


def system_resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return [str(info[4][0]) for info in infos]


@dataclass(frozen=True, slots=True)
class HttpsFetch:
    """The fetch of one URL's bytes (`__call__`); the MediaReader's default."""

    timeout_s: float = FETCH_TIMEOUT_S
    allow_private: bool = False  # loopback, private, link-local … addresses allowed too
    max_redirects: int = MAX_REDIRECTS
    # None: the system's trusted certificates. Tests pass a context that trusts their own CA;
    # nothing in production sets it.
    ssl_context: ssl.SSLContext | None = None
    resolve: Resolve = system_resolve
    clock: Callable[[], float] = field(default=time.monotonic)

    def __call__(
        self, url: str, limit: int, cancel: Cancel | None = None
    ) -> tuple[bytes, str | None]:
        """GET url: its bytes (at most limit + 1 read) and content type, or FetchRefused."""
        cancel = cancel or Cancel()
        deadline = self.clock() + self.timeout_s
        context = self.ssl_context or ssl.create_default_context()
        for _ in range(self.max_redirects + 1):
            status, location, data, media_type = self._get(url, limit, deadline, context, cancel)
            if status not in _REDIRECTS:
                if not 200 <= status < 300:
                    raise FetchRefused(f"the server answered HTTP {status}")
                return data, media_type
            if not location:
                raise FetchRefused(f"the server answered HTTP {status} with no Location")
            url = urljoin(url, location)
            if urlsplit(url).scheme.lower() != "https":
                raise FetchRefused("the server redirected to a URL that is not https")
        raise FetchRefused(f"more than {self.max_redirects} redirects")

    def _get(
        self, url: str, limit: int, deadline: float, context: ssl.SSLContext, cancel: Cancel
    ) -> tuple[int, str | None, bytes, str | None]:
        """One hop: (status, Location, body, content type); the body only of a 2xx answer."""
        parts = urlsplit(url)
        if parts.scheme.lower() != "https" or not parts.hostname:
            raise FetchRefused("only https URLs are fetched")
        host = parts.hostname
        if any(ch <= " " or ch == "\x7f" for ch in url):
            raise FetchRefused("the URL holds spaces or control characters")
        try:
            port = parts.port or 443
        except ValueError:
            raise FetchRefused("the URL's port is not a number") from None
        address = self._address(host, port, deadline)
        cancel.check()
        left = _left(deadline, self.clock, self.timeout_s)
        try:
            raw = socket.create_connection((address, port), timeout=left)
        except TimeoutError:
            raise FetchRefused(_too_slow(self.timeout_s)) from None
        except OSError as exc:
            raise FetchRefused(f"the connection failed ({exc.strerror or exc})") from None
        cancel.watch(raw)
        sock: socket.socket = raw
        try:
            raw.settimeout(_left(deadline, self.clock))
            sock = context.wrap_socket(raw, server_hostname=host, do_handshake_on_connect=False)
            cancel.watch(sock)  # (the plain socket is detached now)
            sock.do_handshake()  # bounded: CPython's handshake keeps one deadline of the timeout
            target = parts.path or "/"
            if parts.query:
                target += "?" + parts.query
            netloc = host if parts.port is None else f"{host}:{parts.port}"
            if ":" in host:
                netloc = f"[{host}]" if parts.port is None else f"[{host}]:{parts.port}"
            head = f"GET {target} HTTP/1.1\r\nHost: {netloc}\r\nUser-Agent: batchmlx\r\n"
            request = head + "Accept: */*\r\nAccept-Encoding: identity\r\nConnection: close\r\n\r\n"
            sock.settimeout(_left(deadline, self.clock))
            sock.sendall(request.encode("ascii", "strict"))
            resp = http.client.HTTPResponse(_DeadlineSocket(sock, deadline, self.clock, cancel))  # type: ignore[arg-type]
            resp.begin()
            if resp.status in _REDIRECTS or not 200 <= resp.status < 300:
                return resp.status, resp.getheader("Location"), b"", None
            length = resp.getheader("Content-Length")
            if length and length.strip().isdigit() and int(length) > limit:
                raise TooLarge  # not read
            data = _read_up_to(resp, limit + 1)
            return resp.status, None, data, resp.headers.get_content_type()
        except FetchRefused:
            raise
        except _Deadline:
            raise FetchRefused(_too_slow(self.timeout_s)) from None
        except TimeoutError:
            cancel.check()
            raise FetchRefused(_too_slow(self.timeout_s)) from None
        except ssl.SSLCertVerificationError as exc:
            raise FetchRefused(f"the server's certificate was refused ({exc.verify_message})") \
                from None  # fmt: skip
        except (ssl.SSLError, http.client.HTTPException, OSError, UnicodeError) as exc:
            cancel.check()
            why = type(exc).__name__ if isinstance(exc, http.client.HTTPException) else exc
            raise FetchRefused(f"the connection failed ({why})") from None
        finally:
            cancel.forget(raw)
            cancel.forget(sock)
            sock.close()

    def _address(self, host: str, port: int, deadline: float) -> str:
        """The one address the fetch connects to: `host` resolved once, every answer allowed."""
        try:
            literal: IP | None = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if literal is not None:
            answers = [str(literal)]
        else:
            try:
                answers = self.resolve(host, port)
            except (OSError, UnicodeError) as exc:
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                raise FetchRefused(f"the host name could not be resolved ({why})") from None
            _left(deadline, self.clock, self.timeout_s)
        if not answers:
            raise FetchRefused("the host name has no address")
        if not self.allow_private:
            for a in answers:
                problem = address_problem(ipaddress.ip_address(a.split("%", 1)[0]))
                if problem is not None:
                    raise FetchRefused(
                        f"the host {'is' if literal is not None else 'resolves to'} {problem}; "
                        "fetching from loopback, private, link-local and other non-global "
                        "addresses is turned off here ($BATCHMLX_MEDIA_FETCH_PRIVATE)"
                    )
        return answers[0]


class _Deadline(Exception):
    pass


def _too_slow(timeout_s: float) -> str:
    return f"the fetch took longer than its {timeout_s:g} s limit"


def _left(deadline: float, clock: Callable[[], float], timeout_s: float | None = None) -> float:
    """Seconds left before `deadline`; past it, the fetch ends."""
    left = deadline - clock()
    if left <= 0:
        if timeout_s is not None:
            raise FetchRefused(_too_slow(timeout_s))
        raise _Deadline
    return left


def _read_up_to(resp: http.client.HTTPResponse, n: int) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < n:
        chunk = resp.read(min(65536, n - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class _DeadlineSocket:
    """What http.client.HTTPResponse reads from: the socket, each read given the time left."""

    def __init__(
        self, sock: socket.socket, deadline: float, clock: Callable[[], float], cancel: Cancel
    ) -> None:
        self._sock, self._deadline, self._clock, self._cancel = sock, deadline, clock, cancel

    def makefile(self, mode: str = "rb") -> io.BufferedReader:
        del mode
        return io.BufferedReader(_DeadlineReader(self))

    def readinto(self, b: memoryview) -> int:
        self._cancel.check()
        self._sock.settimeout(_left(self._deadline, self._clock))
        n = self._sock.recv_into(b)
        self._cancel.check()
        return n


class _DeadlineReader(io.RawIOBase):
    def __init__(self, owner: _DeadlineSocket) -> None:
        self._owner = owner

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        return self._owner.readinto(memoryview(b).cast("B"))
