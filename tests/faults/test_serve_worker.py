"""`serve` never runs without a live worker: a worker that stops by itself is restarted, the
online requests it held get an error response (never a hang), and a worker that keeps stopping
shuts the server down with a non-zero exit. A real `batchmlx serve` process, tiny model; the
worker is broken by BATCHMLX_FAIL_AT=worker_loop (raised between ticks while online requests
run, outside the tick's own fault handling)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.server.helpers import start_server


def _chat(server, *, stream: bool = False) -> tuple[int, object]:
    body = {"model": "default", "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 40, "stream": stream}  # fmt: skip
    return server.raw("POST", "/chat/completions", json.dumps(body).encode(),
                      {"Content-Type": "application/json"})  # fmt: skip


def test_worker_restarted_and_waiting_request_gets_an_error(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHMLX_FAIL_AT", "worker_loop:1:error")
    server = start_server(tmp_path, "--model", str(tiny_model_dir))
    try:
        status, data = _chat(server, stream=True)  # the worker dies while it streams
        assert status == 200
        text = data.decode()
        assert '"code":"worker_stopped"' in text and text.endswith("data: [DONE]\n\n"), text
        status, body = _chat(server)  # a new worker answers
        assert status == 200, body
        assert body["choices"][0]["finish_reason"] in ("length", "stop")
        assert server.proc.poll() is None
    finally:
        server.stop()
    log = server.log.read_text()
    assert "the worker stopped" in log and "worker restarted" in log, log


def test_server_exits_nonzero_when_the_worker_keeps_stopping(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchmlx.server.supervisor import MAX_RESTARTS

    monkeypatch.setenv("BATCHMLX_FAIL_AT", "worker_loop:*:error")
    server = start_server(tmp_path, "--model", str(tiny_model_dir))
    try:
        for _ in range(MAX_RESTARTS + 1):  # each request stops a worker
            status, body = _chat(server)
            assert status == 503 and body["error"]["code"] == "worker_stopped", (status, body)
        assert server.proc.wait(timeout=60) == 1, server.log.read_text()
    finally:
        server.stop()
    assert "shutting the server down" in server.log.read_text()
