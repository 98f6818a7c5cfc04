"""Two worker processes on one SQLite file, batches submitted while they run: every request
runs once (no request is ever owned by both), one result each, never "database is locked"."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

from tests.crash.harness import Scenario
from tests.e2e.helpers import chat_body, request_line, write_jsonl


def test_two_workers_one_database(tmp_path: Path, tiny_model_dir: Path) -> None:
    s = Scenario.new(tmp_path, tiny_model_dir, batches=1, per_batch=6, max_tokens=8)
    logs = [tmp_path / f"w{i}.log" for i in range(2)]
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchmlx.cli",
                "worker",
                "--model",
                str(tiny_model_dir),
                "--max-batch-size",
                "2",
            ],
            env=s.cli.env,
            cwd=tmp_path,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        for log in logs
    ]
    try:
        # submit through the real CLI, several at once, while both workers write
        files = []
        for b in range(1, 4):
            ids = [f"b{b}-r{i}" for i in range(6)]
            body = [request_line(i, chat_body(i, model="default", max_tokens=8)) for i in ids]
            files.append((write_jsonl(tmp_path / f"more{b}.jsonl", body), ids))
        subs = [
            subprocess.Popen(
                [sys.executable, "-m", "batchmlx.cli", "submit", str(p), "--json"],
                env=s.cli.env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
            for p, _ in files
        ]
        for sub, (_, ids) in zip(subs, files, strict=True):
            out, err = sub.communicate(timeout=120)
            assert sub.returncode == 0, err
            assert "database is locked" not in out + err
            s.inputs[json.loads(out)["id"]] = ids

        deadline = time.monotonic() + 180
        while True:
            with closing(s.db()) as conn:
                open_ = conn.execute(
                    "SELECT COUNT(*) FROM batches WHERE status NOT IN ('completed','failed')"
                ).fetchone()[0]
            if not open_:
                break
            for w, log in zip(workers, logs, strict=True):
                assert w.poll() is None, log.read_text()
            assert time.monotonic() < deadline, [log.read_text() for log in logs]
            time.sleep(0.3)
    finally:
        for w in workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
        rcs = [w.wait(timeout=30) for w in workers]
    texts = [log.read_text() for log in logs]
    assert rcs == [0, 0], texts
    for t in texts:
        assert "database is locked" not in t and "Traceback" not in t, t
    s.check_done()
    # claimed exactly once each: no request was ever owned by two workers
    assert set(s.attempts().values()) == {1}
    with closing(s.db()) as conn:
        holders = {w for (w,) in conn.execute("SELECT DISTINCT worker_id FROM requests")}
    assert len(holders) == 2, holders  # both took part
