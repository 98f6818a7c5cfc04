"""Bad input over HTTP fails once, clearly: a body nested past what can be stored, and a file of
garbage whose error list is cut to its first errors and a count. A real `--no-worker` server."""

from __future__ import annotations

import json

import pytest

from batchmlx.formats.validate import MAX_REPORTED_ERRORS
from tests.e2e.helpers import chat_body, request_line
from tests.server.helpers import start_server, wait_batch


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("api-bad"), "--no-worker")
    yield s
    s.stop()


def _create(client, data: bytes):
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )


def test_deep_nesting_fails_and_the_batch_is_not_stuck(server) -> None:
    client = server.client()
    line = request_line("deep", chat_body("q", response_format=[[[]]]))
    deep = json.dumps(line).replace("[[[]]]", "[" * 300 + "]" * 300) + "\n"  # orjson reads it
    b = wait_batch(client, _create(client, deep.encode()).id, timeout=60)
    assert b.status == "failed"
    assert [(e.code, e.line, e.param) for e in b.errors.data] == [("invalid_json_line", 1, "body")]
    assert "Traceback" not in server.log.read_text()


def test_a_file_of_garbage_gives_a_short_error_list(server) -> None:
    client = server.client()
    b = wait_batch(client, _create(client, b"x\n" * 5_000).id, timeout=60)
    assert b.status == "failed"
    assert len(b.errors.data) == MAX_REPORTED_ERRORS + 1
    last = b.errors.data[-1]
    assert last.code == "too_many_errors" and "5,000 in all" in last.message
    listed = client.batches.list(limit=100).data
    assert [x.errors for x in listed if x.id == b.id] == [b.errors]
