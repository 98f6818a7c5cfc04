"""A `serve` killed while its batch sequences are preempted by online work (issue 49): a real
server process on a real SQLite file, the tiny random model, two batch sequences running at
--max-batch-size 2. The engine is held after its second step (BATCHMLX_PAUSE_AT, on the engine's
thread: the HTTP server still answers) while an online chat arrives; the next step preempts a
batch sequence for it and the process SIGKILLs itself there (after_preemption). A restarted
worker completes every line exactly once, with the text a run without preemption gives."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
from pathlib import Path

from tests.crash.harness import KILLED, Scenario, run_ok
from tests.server.helpers import start_server

LINES = 5
MAX_TOKENS = 16  # still decoding when the online request comes (after the second step)


def _scenario(base: Path, model: Path) -> Scenario:
    return Scenario.new(
        base, model, batches=1, per_batch=LINES, max_tokens=MAX_TOKENS, temperature=0
    )  # greedy: the text is the tokens' witness


def _texts(s: Scenario) -> dict[str, str]:
    """custom_id -> the generated text, from the completed batch's output file."""
    (obj,) = s.check_done().values()
    assert obj["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}
    lines = (s.cli.home / "files" / obj["output_file_id"]).read_text().splitlines()
    out = {}
    for ln in lines:
        rec = json.loads(ln)
        out[rec["custom_id"]] = rec["response"]["body"]["choices"][0]["message"]["content"]
    return out


def _wait_for(path: Path, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"server exited {proc.returncode} before {path.name}"
        assert time.monotonic() < deadline, f"{path.name} not reached in {timeout} s"
        time.sleep(0.05)


def test_serve_killed_while_online_work_preempts_batch_sequences(tmp_path: Path, tiny_model_dir):
    plain = _scenario(tmp_path / "plain", tiny_model_dir)
    run_ok(plain.worker())  # the same lines, never preempted (nothing more urgent comes)
    expected = _texts(plain)

    s = _scenario(tmp_path / "crash", tiny_model_dir)
    pause = tmp_path / "pause"
    pause.mkdir()
    faults = {"BATCHMLX_PAUSE_AT": "mid_generation:2", "BATCHMLX_PAUSE_DIR": str(pause),
              "BATCHMLX_CRASH_AT": "after_preemption:1"}  # fmt: skip
    server = start_server(tmp_path / "crash", "--model", str(tiny_model_dir),
                          "--max-batch-size", "2", env=faults)  # fmt: skip
    try:
        _wait_for(pause / "mid_generation.reached", server.proc)
        body = {"model": "default", "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hello there"}]}  # fmt: skip

        def online() -> None:  # its connection dies with the server
            try:
                server.raw("POST", "/chat/completions", json.dumps(body).encode(),
                           {"Content-Type": "application/json"})  # fmt: skip
            except (urllib.error.URLError, ConnectionError):
                pass

        client = threading.Thread(target=online, daemon=True)
        client.start()
        # the event loop is free while the engine waits: the ticket is queued in milliseconds
        # (nothing shows it from outside; were it later, the batch still runs a while)
        time.sleep(1.0)
        (pause / "mid_generation.go").touch()  # the engine goes on: the online request preempts
        rc = server.proc.wait(120)
        assert rc == KILLED, f"after_preemption never reached (rc {rc}):\n{server.log.read_text()}"
        client.join(10)
    finally:
        server.stop()
    s.check_consistent()
    run_ok(s.worker())  # the restarted worker takes the dead server's lines back
    assert _texts(s) == expected  # every line once, the same greedy text
    assert max(s.attempts().values()) == 2  # the preempted lines ran again after the kill
