"""Pure rules of the HTTP layer and the window parser: which Host and Origin a server accepts,
how a bearer header is read, which completion windows parse."""

from __future__ import annotations

import pytest

from batchmlx.batches.errors import BatchError
from batchmlx.batches.windows import MAX_WINDOW_S, parse_window
from batchmlx.server.auth import bearer_token
from batchmlx.server.guard import HostPolicy, host_name


@pytest.mark.parametrize(
    ("window", "seconds"),
    [("24h", 86400), ("90m", 5400), ("2d", 172800), ("30s", 30), ("024h", 86400),
     ("365d", MAX_WINDOW_S)],
)  # fmt: skip
def test_windows_that_parse(window, seconds):
    assert parse_window(window) == seconds


@pytest.mark.parametrize(
    "window",
    ["1_0h", "٣h", "１h", "+5h", "-1h", " 24h", "24h\n", "24 h", "24H", "h", "", "0h", "24",
     "366d", "99999999999999999999d", "1.5h"],
)  # fmt: skip
def test_windows_refused(window):
    with pytest.raises(BatchError):
        parse_window(window)


def test_host_names():
    assert host_name("Example.ORG:8000") == "example.org"
    assert host_name("[::1]:8000") == "::1"
    assert host_name("127.0.0.1") == "127.0.0.1"
    assert host_name("[::1") is None
    assert host_name("attacker.example@127.0.0.1") is None
    assert host_name("localhost:http") is None


def test_loopback_bind_answers_loopback_names_and_addresses_only():
    p = HostPolicy.for_bind("127.0.0.1", api_key=None, extra=())
    assert [p.allows_host(h) for h in ("localhost", "127.0.0.1", "::1", "10.0.0.7")] == [True] * 4
    assert not p.allows_host("attacker.example")
    # a key does not widen a loopback server: nothing remote should be naming it
    assert not HostPolicy.for_bind("127.0.0.1", api_key="k", extra=()).allows_host("a.example")


def test_remote_bind_answers_any_name_only_with_a_key():
    assert HostPolicy.for_bind("0.0.0.0", api_key="k", extra=()).allows_host("box.lan")
    keyless = HostPolicy.for_bind("0.0.0.0", api_key=None, extra=("Box.LAN:8000",))
    assert keyless.allows_host("box.lan") and keyless.allows_host("192.168.1.5")
    assert not keyless.allows_host("attacker.example")
    assert HostPolicy.for_bind("box.lan", api_key=None, extra=()).allows_host("box.lan")


def test_origin_must_be_the_servers_own_or_an_added_name():
    p = HostPolicy.for_bind("127.0.0.1", api_key=None, extra=("proxy.example",))
    assert p.allows_origin("http://127.0.0.1:8000", "127.0.0.1:8000")
    assert p.allows_origin("http://LOCALHOST:8000", "localhost:8000")
    assert p.allows_origin("https://proxy.example", "127.0.0.1:8000")
    assert not p.allows_origin("http://localhost:3000", "localhost:8000")  # another port
    assert not p.allows_origin("http://attacker.example", "127.0.0.1:8000")
    assert not p.allows_origin("null", "127.0.0.1:8000")  # sandboxed frames, file:// pages


def test_bearer_scheme_is_case_insensitive():
    for header in (b"Bearer sk-1", b"bearer sk-1", b"BEARER  sk-1 "):
        assert bearer_token(header) == b"sk-1"
    assert bearer_token(b"Basic sk-1") is None
    assert bearer_token(b"sk-1") is None
    assert bearer_token(b"") is None
