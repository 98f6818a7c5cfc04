"""`batchmlx serve --no-worker` on a PostgreSQL that goes away and comes back (a server of its
own, stopped and started again on the same port and data): while it is down every route
answers 503 `database_unavailable` with Retry-After, never a 500 with a traceback; the first
request after it is back is fine; and the validator, which met the outage in its poll, still
validates the next batch (it used to die silently, leaving every batch `validating`)."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.helpers import chat_body, request_line
from tests.faults.pg_restart import down, start_postgres, up
from tests.server.helpers import jsonl, start_server, wait_validated

ROUTES = ("/v1/batches", "/v1/files", "/v1/files/file-x", "/v1/batches/batch_x",
          "/dashboard/api/summary", "/dashboard/api/batches/batch_x", "/metrics")  # fmt: skip


@pytest.fixture(scope="module")
def own_pg():
    server = start_postgres()
    yield server
    server.stop()


@pytest.fixture
def api(own_pg, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHMLX_DATABASE_URL", own_pg.new_database())
    server = start_server(tmp_path / "api", "--no-worker")
    yield server
    server.stop()
    if own_pg.proc.poll() is not None:
        up(own_pg)  # a failed test leaves the database up for the next


def _get(api, path: str):
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{api.port}{path}", timeout=60) as r:
            return r.status, r.headers, r.read()  # headers: any case
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def _good_file() -> bytes:
    return jsonl([request_line(f"r{i}", chat_body(f"q{i}", max_tokens=1)) for i in range(2)])


def test_database_down_is_503_on_every_route_then_the_first_request_is_fine(api, own_pg):
    client = api.client()
    client.files.create(file=("in.jsonl", _good_file()), purpose="batch")
    for path in ROUTES:  # every pooled connection has been used before the outage
        _get(api, path)
    down(own_pg)
    try:
        for path in ROUTES:
            status, headers, body = _get(api, path)
            assert status == 503, (path, status, body)
            assert json.loads(body)["error"]["code"] == "database_unavailable", (path, body)
            assert headers["Retry-After"] == "1", (path, dict(headers))
    finally:
        up(own_pg)
    for path in ("/v1/batches", "/v1/files", "/dashboard/api/summary", "/metrics"):
        status, _, body = _get(api, path)
        assert status == 200, (path, status, body)
    log = api.log.read_text()
    assert "Traceback" not in log, log[-3000:]
    assert "the database is unavailable" in log


def test_the_validator_survives_a_database_restart(api, own_pg):
    client = api.client()
    time.sleep(1.5)  # the validator is polling (once a second)
    down(own_pg)
    time.sleep(4)  # down for 4 s: the validator's polls meet the outage
    up(own_pg)
    f = client.files.create(file=("in.jsonl", _good_file()), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    batch = wait_validated(client, batch.id)  # it stayed validating: the validator had died
    assert batch.status == "in_progress", batch.errors
    log = api.log.read_text()
    assert "the validator: the database is unavailable" in log and "retrying in" in log, log
