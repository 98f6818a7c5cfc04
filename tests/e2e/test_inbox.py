"""`batchmlx worker --inbox DIR`: files already there, a slow writer, a duplicate, a bad file;
results land in DIR/results/ when each batch ends. A real worker process, a real SQLite file."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

from tests.crash.harness import Scenario
from tests.e2e.helpers import chat_body, make_cli, request_line


def _line(cid: str) -> str:
    return json.dumps(request_line(cid, chat_body(cid, model="default", max_tokens=4))) + "\n"


def _wait_for(pred, proc, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def test_inbox(tmp_path: Path, tiny_model_dir: Path) -> None:
    s = Scenario(make_cli(tmp_path), tiny_model_dir)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "early.jsonl").write_text("".join(_line(f"e{i}") for i in range(3)))
    log = tmp_path / "worker.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchmlx.cli", "worker", "--model", str(tiny_model_dir),
         "--inbox", str(inbox), "--inbox-settle", "0.6"],
        env=s.cli.env, cwd=tmp_path, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        results = inbox / "results"
        _wait_for(lambda: (results / "early.output.jsonl").exists(), proc, log)
        assert (inbox / "done" / "early.jsonl").exists() and not (inbox / "early.jsonl").exists()

        # a slow writer: whole lines, and one line cut in half, never 0.6 s apart in quiet...
        slow = inbox / "slow.jsonl"
        with slow.open("w") as f:
            for i in range(6):
                f.write(_line(f"s{i}"))
                f.flush()
                time.sleep(0.3)
            half = _line("s6")
            f.write(half[:20])
            f.flush()
            time.sleep(0.9)  # past the settle time, but no final newline yet: not complete
            assert slow.exists(), "ingested while a line was half-written"
            f.write(half[20:])
        # the same content as early.jsonl again: no second batch; and a file that is not JSON
        (inbox / "again.jsonl").write_text((inbox / "done" / "early.jsonl").read_text())
        (inbox / "bad.jsonl").write_text('{"custom_id": "x", broken\n')

        _wait_for(lambda: (results / "slow.output.jsonl").exists(), proc, log)
        _wait_for(lambda: (inbox / "failed" / "bad.errors.json").exists(), proc, log)
        _wait_for(lambda: (inbox / "done" / "again.jsonl").exists(), proc, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    text = log.read_text()
    assert rc == 0 and "Traceback" not in text, text

    slow_out = [json.loads(x) for x in (results / "slow.output.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in slow_out) == [f"s{i}" for i in range(7)]
    early = [json.loads(x) for x in (results / "early.output.jsonl").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in early) == ["e0", "e1", "e2"]
    assert not (results / "slow.errors.jsonl").exists()
    report = json.loads((inbox / "failed" / "bad.errors.json").read_text())
    assert report["errors"]["data"][0]["line"] == 1
    assert (inbox / "failed" / "bad.jsonl").exists()
    with closing(s.db()) as conn:
        rows = conn.execute("SELECT status, source FROM batches ORDER BY created_at").fetchall()
    # early, slow, bad: the duplicate made no batch
    assert sorted(st for st, _ in rows) == ["completed", "completed", "failed"], rows
    assert all(src.startswith(f"inbox:{inbox.resolve()}/") for _, src in rows)
