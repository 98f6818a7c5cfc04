"""worker/fetch.py against a local https server (tests/https_server.py, loopback only, its own
CA trusted by the test's client context alone): one deadline for the whole fetch, redirects only
to https, non-global addresses refused unless allowed (checked on the address connected to),
refusals as the line's 400 naming the part and never echoing the server's body."""

from __future__ import annotations

import ipaddress
import threading
import time
from pathlib import Path

import pytest

from batchmlx.formats.request import MediaKind, MediaPart, MediaSource
from batchmlx.worker.fetch import Cancel, Cancelled, FetchRefused, HttpsFetch, address_problem
from batchmlx.worker.media import MediaReader, MediaRefused
from tests.https_server import BODY, SECRET, HttpsServer

pytest.importorskip("cryptography")

PARAM = "messages[0].content[0].image_url.url"


@pytest.fixture
def server(tmp_path: Path):
    s = HttpsServer(tmp_path)
    yield s
    s.close()


def fetcher(server: HttpsServer, **kw) -> HttpsFetch:
    """Loopback allowed (the operator's switch: the test server is on 127.0.0.1)."""
    return HttpsFetch(ssl_context=server.client_context(), **{"allow_private": True, **kw})


def refusal(fetch: HttpsFetch, url: str) -> str:
    with pytest.raises(FetchRefused) as info:
        fetch(url, 1 << 20)
    return str(info.value)


def test_a_fetch_reads_the_body_and_its_type(server):
    assert fetcher(server)(server.url("/ok"), 1 << 20) == (BODY, "image/png")
    # the system's trust store does not know the test CA: nothing is trusted implicitly
    assert "certificate" in refusal(HttpsFetch(allow_private=True), server.url("/ok"))


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "0.0.0.0", "::1",
     "::", "fd00::1", "fe80::1", "224.0.0.1", "ff02::1", "::ffff:127.0.0.1", "100.64.0.1",
     "192.0.2.1", "240.0.0.1",
     "2002:a00:1::1", "2002:7f00:1::1"],  # 6to4 around 10.0.0.1 and 127.0.0.1
)  # fmt: skip
def test_non_global_addresses_are_refused(address):
    assert address_problem(ipaddress.ip_address(address)) is not None


def test_global_addresses_pass():
    for address in ("8.8.8.8", "1.1.1.1", "2606:4700::1111", "2002:808:808::1"):
        assert address_problem(ipaddress.ip_address(address)) is None


def test_loopback_is_refused_without_the_switch_and_nothing_is_sent(server):
    strict = HttpsFetch(ssl_context=server.client_context())  # the production default
    for url in (server.url("/ok"), server.url("/ok", host="localhost")):
        why = refusal(strict, url)
        assert "loopback address" in why and "BATCHMLX_MEDIA_FETCH_PRIVATE" in why
        assert "127.0.0.1" not in why  # where a name points is not told
    assert server.hits == []


def test_the_name_is_resolved_once_and_that_address_connected(server):
    """DNS rebinding: a second lookup cannot switch the address; a private answer is refused."""
    answers = [["127.0.0.1"], ["203.0.113.9"]]  # the second answer is never asked for
    calls: list[str] = []

    def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        return answers[len(calls) - 1]

    fetch = fetcher(server, resolve=resolve)
    assert fetch(server.url("/ok", host="images.test"), 1 << 20)[0] == BODY
    assert calls == ["images.test"] and server.hits == ["/ok"]

    def private(host: str, port: int) -> list[str]:
        return ["8.8.8.8", "10.0.0.7"]  # any private answer refuses the name

    why = refusal(HttpsFetch(ssl_context=server.client_context(), resolve=private),
                  server.url("/ok", host="images.test"))  # fmt: skip
    assert "resolves to a private address" in why and "10.0.0.7" not in why


def test_redirects_only_to_https_and_only_a_few(server):
    assert fetcher(server)(server.url("/to-ok"), 1 << 20)[0] == BODY
    assert "not https" in refusal(fetcher(server), server.url("/to-http"))
    assert "more than 3 redirects" in refusal(fetcher(server), server.url("/loop"))
    assert server.hits.count("/loop") == 4
    assert "only https" in refusal(fetcher(server), f"http://127.0.0.1:{server.port}/ok")


@pytest.mark.parametrize("path", ["/trickle", "/slow-head"])
def test_one_deadline_bounds_the_whole_fetch(server, path):
    """A server that sends a byte every 0.2 s never trips a per-read timeout; the deadline
    ends the fetch anyway (headers or body)."""
    start = time.monotonic()
    why = refusal(fetcher(server, timeout_s=1.0), server.url(path))
    took = time.monotonic() - start
    assert "longer than its 1 s limit" in why
    assert 0.9 < took < 2.0, took


def test_a_cancel_ends_a_fetch_under_way_at_once(server):
    cancel = Cancel()
    out: list[BaseException] = []

    def run() -> None:
        try:
            fetcher(server)(server.url("/trickle"), 1 << 20, cancel)
        except BaseException as exc:
            out.append(exc)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    start = time.monotonic()
    cancel.cancel()
    t.join(2)
    assert not t.is_alive() and time.monotonic() - start < 1.0
    assert isinstance(out[0], Cancelled)


def part(url: str) -> MediaPart:
    return MediaPart(MediaKind.IMAGE, MediaSource.HTTPS, PARAM, 0, url)


def line_error(reader: MediaReader, url: str):
    with pytest.raises(MediaRefused) as info:
        reader.resolve((part(url),))
    e = info.value.error
    assert (e.status_code, e.param) == (400, PARAM)
    assert e.message.startswith(f"Invalid '{PARAM}': the image could not be fetched")
    return e


def test_refusals_are_the_lines_400_naming_the_part_never_the_servers_body(server):
    reader = MediaReader(fetch=fetcher(server))
    e = line_error(reader, server.url("/secret"))
    assert "HTTP 404" in e.message and SECRET.decode() not in e.message
    assert "not https" in line_error(reader, server.url("/to-http")).message
    strict = MediaReader(fetch=HttpsFetch(ssl_context=server.client_context()))
    assert "loopback" in line_error(strict, server.url("/ok")).message
    with pytest.raises(MediaRefused) as info:
        reader.resolve((part(server.url("/big")),))
    assert "at most" in info.value.error.message  # told by Content-Length; nothing read
    (got,) = reader.resolve((part(server.url("/ok")),))
    assert (got.data, got.media_type) == (BODY, "image/png")


def test_a_server_that_never_answers_the_handshake_ends_at_the_deadline():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never speaks TLS
        port = silent.getsockname()[1]
        start = time.monotonic()
        why = refusal(HttpsFetch(timeout_s=1.0, allow_private=True), f"https://127.0.0.1:{port}/")
        took = time.monotonic() - start
    assert "longer than its 1 s limit" in why and 0.9 < took < 2.0, (why, took)
