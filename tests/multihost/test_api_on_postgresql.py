"""The HTTP API on a PostgreSQL queue: uploads land in the database, so the CLI of another home
sees the batch and the same file bytes; file content is streamed back unchanged."""

from __future__ import annotations

import json
import time

from tests.e2e.helpers import chat_body, request_line
from tests.multihost.hosts import make_hosts
from tests.server.helpers import jsonl, start_server


def test_api_server_and_cli_of_another_home_share_one_queue(pg_url, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHMLX_DATABASE_URL", pg_url)
    server = start_server(tmp_path / "api", "--no-worker")
    try:
        client = server.client()
        data = jsonl([request_line(f"r{i}", chat_body(f"q{i}", max_tokens=1)) for i in range(3)])
        f = client.files.create(file=("in.jsonl", data), purpose="batch")
        assert client.files.content(f.id).content == data
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h")  # fmt: skip
        deadline = time.monotonic() + 120
        while (batch := client.batches.retrieve(batch.id)).status == "validating":
            assert time.monotonic() < deadline, "never validated"
            time.sleep(0.2)
        assert batch.status == "in_progress", batch.errors
        (other,) = make_hosts(tmp_path, pg_url, 1, prefix="laptop")
        seen = other.cli_json("status", batch.id)
        assert seen["id"] == batch.id and seen["request_counts"]["total"] == 3
        assert not (server.home / "files").exists()  # the bytes live in the database
    finally:
        server.stop()
    assert json.loads(data.splitlines()[0])["custom_id"] == "r0"
