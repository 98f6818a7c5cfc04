"""A keyless `--no-worker` server against what a web page, a careless client or a broken data
directory can send it: foreign Host and Origin, non-JSON and oversized bodies, failures that
must still come back in OpenAI's envelope, windows OpenAI refuses, expiry with no worker, and
a data directory that is the user's alone."""

from __future__ import annotations

import http.client
import json
import os
import sqlite3
import stat
import time

import pytest

from batchmlx.server.context import DEFAULT_MAX_JSON_BYTES as MAX_JSON_BYTES
from tests.e2e.helpers import Cli, chat_body, request_line
from tests.server.helpers import jsonl, start_server

CHUNK = 1024 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    old = os.umask(0o022)  # the usual umask: the data directory must be private anyway
    try:
        s = start_server(
            tmp_path_factory.mktemp("guards"),
            "--no-worker",
            "--allowed-host",
            "box.lan",
            "--allowed-host",
            "proxy.example",
        )
    finally:
        os.umask(old)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def good_file() -> bytes:
    return jsonl([request_line(f"r{i}", chat_body(f"q{i}", max_tokens=4)) for i in range(2)])


def _error(body: dict) -> dict:
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _create_body(file_id: str, window: str = "24h") -> bytes:
    return json.dumps({"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                       "completion_window": window}).encode()  # fmt: skip


JSON = {"Content-Type": "application/json"}


def test_foreign_host_is_refused(server):
    for host in ("attacker.example", f"attacker.example:{server.port}", "127.0.0.1.nip.io",
                 "attacker.example@127.0.0.1"):  # fmt: skip
        status, body = server.raw("GET", "/files", headers={"Host": host})
        assert status == 400 and _error(body)["code"] == "invalid_host", (host, body)
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", f"[::1]:{server.port}",
                 "localhost", f"box.lan:{server.port}", "proxy.example"):  # fmt: skip
        status, body = server.raw("GET", "/files", headers={"Host": host})
        assert status == 200 and body["object"] == "list", (host, body)


def test_foreign_origin_cannot_create_a_batch(server, client):
    f = client.files.create(file=("in.jsonl", good_file()), purpose="batch")
    before = [b.id for b in client.batches.list(limit=100)]
    for origin in ("http://attacker.example", "null", f"http://localhost:{server.port + 1}"):
        for ctype in ("text/plain", "application/json"):
            status, body = server.raw("POST", "/batches", _create_body(f.id),
                                      {"Content-Type": ctype, "Origin": origin})  # fmt: skip
            assert status == 403 and _error(body)["code"] == "forbidden_origin", (origin, body)
    # a form upload from a foreign page is refused the same way
    status, body = server.raw(
        "POST",
        "/files",
        b"--x--\r\n",
        {"Content-Type": "multipart/form-data; boundary=x", "Origin": "http://attacker.example"},
    )
    assert status == 403, body
    assert [b.id for b in client.batches.list(limit=100)] == before
    # a page the server itself serves (same origin) works
    own = {**JSON, "Origin": f"http://127.0.0.1:{server.port}"}
    status, body = server.raw("POST", "/batches", _create_body(f.id), own)
    assert status == 200 and body["status"] == "validating", body


def test_json_endpoints_require_a_json_body(server, client):
    f = client.files.create(file=("in.jsonl", good_file()), purpose="batch")
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()
    for path, data in (("/batches", _create_body(f.id)), ("/chat/completions", chat)):
        for ctype in ("text/plain", "application/x-www-form-urlencoded",
                      "multipart/form-data; boundary=x"):  # fmt: skip
            status, body = server.raw("POST", path, data, {"Content-Type": ctype})
            assert status == 415 and _error(body)["code"] == "unsupported_media_type", (
                path, ctype, body)  # fmt: skip
    status, body = server.raw("POST", "/batches", _create_body(f.id),
                              {"Content-Type": "Application/JSON; charset=utf-8"})  # fmt: skip
    assert status == 200, body


def _open(server) -> http.client.HTTPConnection:
    # a guard against a server that waits for a body never sent: the old one did
    return http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)


def test_declared_oversized_json_body_is_413_before_it_is_sent(server):
    conn = _open(server)
    conn.putrequest("POST", "/v1/chat/completions")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", str(MAX_JSON_BYTES + 1))
    conn.endheaders()  # and not one byte of the body
    resp = conn.getresponse()
    assert resp.status == 413
    assert _error(json.loads(resp.read()))["code"] == "request_too_large"
    conn.close()


def test_chunked_json_body_is_cut_off_at_the_bound(server):
    conn = _open(server)
    conn.putrequest("POST", "/v1/batches")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Transfer-Encoding", "chunked")
    conn.endheaders()
    sent = 0
    while sent <= MAX_JSON_BYTES:  # one byte past the bound, and the body never ends
        conn.send(b"%x\r\n%s\r\n" % (CHUNK, b" " * CHUNK))
        sent += CHUNK
    resp = conn.getresponse()
    assert resp.status == 413
    assert _error(json.loads(resp.read()))["code"] == "request_too_large"
    conn.close()


@pytest.mark.parametrize(
    "window", ["99999999999999999999d", "48h", "1_0h", "٣h", "24H", "1440m", 24, None]
)
def test_completion_window_is_24h_only(server, client, window):
    f = client.files.create(file=("in.jsonl", good_file()), purpose="batch")
    body = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": window}
    status, answer = server.raw("POST", "/batches", json.dumps(body).encode(), JSON)
    assert status == 400 and _error(answer)["param"] == "completion_window", answer


def test_stream_must_be_a_boolean(server):
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for extra, param in (({"stream": 1}, "stream"), ({"stream": "true"}, "stream"),
                         ({"stream": True, "stream_options": 5}, "stream_options"),
                         ({"stream": True, "stream_options": {"include_usage": 1}},
                          "stream_options.include_usage")):  # fmt: skip
        data = json.dumps({**base, **extra}).encode()
        status, body = server.raw("POST", "/chat/completions", data, JSON)
        assert status == 400 and _error(body)["param"] == param, (extra, body)
    # a boolean passes the check and meets the missing worker
    status, _ = server.raw("POST", "/chat/completions", json.dumps(base).encode(), JSON)
    assert status == 503


def test_content_whose_bytes_are_gone(server, client):
    f = client.files.create(file=("gone.jsonl", good_file()), purpose="batch")
    path = server.home / "files" / f.id
    path.unlink()
    status, body = server.raw("GET", f"/files/{f.id}/content")
    assert status == 410 and _error(body)["code"] == "file_content_missing", body
    path.mkdir()  # unreadable in a way nobody planned for: still the envelope, with a 500
    status, body = server.raw("GET", f"/files/{f.id}/content")
    assert status == 500 and _error(body)["type"] == "server_error", body
    path.rmdir()


def test_upload_while_the_database_is_locked_is_503(server, client):
    files = server.home / "files"
    stored = sorted(p.name for p in files.iterdir())
    lock = sqlite3.connect(server.home / "batchmlx.db", isolation_level=None)
    try:
        lock.execute("BEGIN IMMEDIATE")  # the write lock, held past the server's busy timeout
        multipart = (b"--b\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                     b"--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\""
                     b"\r\n\r\n" + good_file() + b"\r\n--b--\r\n")  # fmt: skip
        status, body = server.raw(
            "POST", "/files", multipart, {"Content-Type": "multipart/form-data; boundary=b"}
        )
        assert status == 503 and _error(body)["code"] == "database_unavailable", body
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert sorted(p.name for p in files.iterdir()) == stored  # no bytes without a record
    assert client.files.create(file=("a.jsonl", good_file()), purpose="batch").bytes > 0


def test_batch_past_its_window_is_expired_on_retrieve(server, tmp_path):
    data = tmp_path / "in.jsonl"
    data.write_bytes(good_file())
    cli = Cli(server.home)
    batches = []
    for _ in range(2):
        done = cli("submit", data, "--model", "default", "--completion-window", "1s", "--json")
        assert done.returncode == 0, done.stderr
        batches.append(json.loads(done.stdout))
    while time.time() <= max(b["expires_at"] for b in batches):
        time.sleep(0.2)
    status, body = server.raw("GET", f"/batches/{batches[0]['id']}")
    assert status == 200 and body["status"] == "expired", body
    status, errors = server.raw("GET", f"/files/{body['error_file_id']}/content")
    assert status == 200 and errors.count(b"batch_expired") == 2
    # `batchmlx status` applies the window the same way
    shown = cli("status", batches[1]["id"], "--json")
    assert shown.returncode == 0 and json.loads(shown.stdout)["status"] == "expired", shown


def test_the_data_directory_is_the_users_alone(server, client):
    client.files.create(file=("in.jsonl", good_file()), purpose="batch")  # files/ exists
    home = server.home
    names = {p.name for p in home.iterdir()}
    assert {"batchmlx.db", "batchmlx.db-wal", "batchmlx.db-shm", "files"} <= names, names
    for folder in (home, *(p for p in home.rglob("*") if p.is_dir())):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    for f in (p for p in home.rglob("*") if p.is_file()):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
