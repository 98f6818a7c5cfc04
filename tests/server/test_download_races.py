"""A real `serve --no-worker` on SQLite (bytes under files/) and on PostgreSQL (bytes in the
database): a download racing a delete of the same file gets the whole file or a 404 in
OpenAI's envelope, never a 500 or a cut-off body (it was a 500 in 25 of 40 rounds on SQLite,
12 of 40 on PostgreSQL); and the dashboard still renders a batch whose error file is gone."""

from __future__ import annotations

import http.client
import json
import threading
import time

import pytest

from tests.e2e.helpers import Cli, chat_body, request_line
from tests.server.helpers import start_server

ROUNDS = 40


@pytest.fixture
def server(dialect, tmp_path, monkeypatch, request):
    if dialect == "postgresql":
        monkeypatch.setenv("BATCHMLX_DATABASE_URL", request.getfixturevalue("pg_url"))
    s = start_server(tmp_path / "api", "--no-worker")
    yield s
    s.stop()


def _request(port: int, method: str, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request(method, path)
        resp = conn.getresponse()
        return resp.status, resp.read()  # IncompleteRead for a body cut short
    finally:
        conn.close()


def _race(port: int, file_id: str) -> dict[str, tuple[int, bytes]]:
    """GET the content and DELETE the file at once; each one's (status, body)."""
    got: dict[str, tuple[int, bytes]] = {}
    start = threading.Barrier(2)

    def go(name: str, method: str, path: str) -> None:
        start.wait()
        got[name] = _request(port, method, path)

    threads = [
        threading.Thread(target=go, args=("get", "GET", f"/v1/files/{file_id}/content")),
        threading.Thread(target=go, args=("delete", "DELETE", f"/v1/files/{file_id}")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def test_a_download_racing_a_delete_is_the_file_or_a_404(server):
    data = b"".join(b'{"line": %d}\n' % i for i in range(2000))
    client = server.client()
    outcomes: dict[int, int] = {}
    for _ in range(ROUNDS):
        f = client.files.create(file=("in.jsonl", data), purpose="batch")
        got = _race(server.port, f.id)
        assert got["delete"][0] == 200, got["delete"]
        status, body = got["get"]
        outcomes[status] = outcomes.get(status, 0) + 1
        if status == 200:
            assert body == data, "a cut-off or mixed body"
        else:
            assert status == 404, (status, body)
            err = json.loads(body)["error"]
            assert err["code"] == "not_found" and f.id in err["message"], err
    print("download racing delete, statuses over", ROUNDS, "rounds:", outcomes)
    assert set(outcomes) <= {200, 404}, outcomes
    assert "Traceback" not in server.log.read_text()


def test_the_dashboard_renders_a_batch_whose_error_file_is_gone(server, tmp_path):
    data = tmp_path / "in.jsonl"  # a batch that expires with no worker: an error file
    data.write_text(json.dumps(request_line("a", chat_body("q", max_tokens=1))) + "\n")
    done = Cli(server.home)("submit", data, "--model", "default", "--completion-window", "1s",
                            "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    batch_id = json.loads(done.stdout)["id"]
    deadline = time.monotonic() + 30
    while (batch := server.client().batches.retrieve(batch_id)).status != "expired":
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.3)
    path = f"/dashboard/api/batches/{batch_id}"
    status, body = _request(server.port, "GET", path)
    assert status == 200 and json.loads(body)["error_lines"][0]["custom_id"] == "a", body
    server.client().files.delete(batch.error_file_id)
    for _ in range(2):  # every time, not only the first
        status, body = _request(server.port, "GET", path)
        assert status == 200, body
        view = json.loads(body)
        assert view["id"] == batch_id and view["error_file_missing"] is True, view
        assert view["error_lines"] == []
