"""Slow readers of `GET /v1/files/ID/content` on PostgreSQL (file bytes in the database) do
not starve the server: each chunk is read in a short transaction of its own, so a download
that takes minutes holds no pooled connection while its client is not reading. It used to
hold one for its whole stream: 16 of them took the pool (5 + 10 overflow), and every other
route waited 30 s for a connection, then answered 500 "QueuePool limit … reached"."""

from __future__ import annotations

import hashlib
import socket
import time
import urllib.request

from tests.server.helpers import start_server

READERS = 16  # one more than the pool's 5 + 10 connections
SIZE = 8 * 1024 * 1024  # 8 chunks: far more than a stalled reader's socket buffers take


def _stalled_reader(port: int, path: str) -> socket.socket:
    """A client that asks for the content, reads its first bytes, then stops reading."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the server blocks
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    s.settimeout(30)
    assert s.recv(1024).startswith(b"HTTP/1.1 200"), "the download did not start"
    return s


def _timed_get(port: int, path: str) -> tuple[int, float, bytes]:
    t0 = time.monotonic()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=15) as r:
        return r.status, time.monotonic() - t0, r.read()


def test_slow_downloads_hold_no_pooled_connection(pg_url, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHMLX_DATABASE_URL", pg_url)
    server = start_server(tmp_path / "api", "--no-worker")
    readers: list[socket.socket] = []
    try:
        data = b"".join(b"%08d some text to download\n" % i for i in range(SIZE // 32))
        f = server.client().files.create(file=("big.jsonl", data), purpose="batch")
        path = f"/v1/files/{f.id}/content"
        readers = [_stalled_reader(server.port, path) for _ in range(READERS)]
        time.sleep(1)  # each server-side stream is blocked on its client's full window
        took = {}
        for route in ("/v1/files", "/v1/batches", "/v1/models", "/metrics",
                      "/dashboard/api/summary"):  # fmt: skip
            status, took[route], _ = _timed_get(server.port, route)
            assert status == 200, route
        status, took["content"], body = _timed_get(server.port, path)  # a reader that reads
        assert status == 200 and hashlib.sha256(body).digest() == hashlib.sha256(data).digest()
        print("latency with", READERS, "stalled downloads:",
              {k: round(v, 3) for k, v in took.items()})  # fmt: skip
        assert max(took.values()) < 5, took  # it was 30 s, then a 500
    finally:
        for s in readers:
            s.close()
        server.stop()
    assert "QueuePool" not in server.log.read_text()
