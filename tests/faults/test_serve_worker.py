"""`serve` never runs without a live worker: a worker that stops by itself is restarted, the
online requests it held get an error response (never a hang), and a worker that keeps stopping
shuts the server down with a non-zero exit. A real `batchmlx serve` process, tiny model; the
worker is broken by BATCHMLX_FAIL_AT=worker_loop (raised between ticks while online requests
run, outside the tick's own fault handling)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
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


def test_the_api_answers_while_an_engine_step_runs(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine steps on its own thread: a step that takes long (held here at the fault
    point) leaves the HTTP loop free. The base server answered nothing until the step ended."""
    pause = tmp_path / "pause"
    pause.mkdir()
    monkeypatch.setenv("BATCHMLX_PAUSE_AT", "engine_step:1")
    monkeypatch.setenv("BATCHMLX_PAUSE_DIR", str(pause))
    server = start_server(tmp_path, "--model", str(tiny_model_dir))
    answers: list[tuple[int, object]] = []
    chat = threading.Thread(target=lambda: answers.append(_chat(server)))
    try:
        chat.start()
        deadline = time.monotonic() + 60
        while not (pause / "engine_step.reached").exists():
            assert time.monotonic() < deadline and server.proc.poll() is None, server.log
            time.sleep(0.05)
        url = f"{server.base_url}/models"
        for _ in range(3):  # the step is still held: each answer comes from the free loop
            t0 = time.monotonic()
            with urllib.request.urlopen(url, timeout=10) as resp:
                assert resp.status == 200
            assert time.monotonic() - t0 < 2.0
        assert not answers  # the chat still waits on its step
        (pause / "engine_step.go").touch()
        chat.join(60)
        ((status, body),) = answers
        assert status == 200, body
    finally:
        (pause / "engine_step.go").touch()
        server.stop()
