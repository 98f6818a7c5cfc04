"""Fault-suite harness: a long-running `batchmlx worker` process on a real SQLite file, a fault
injected while it works, then the checks every fault must pass: the worker is still alive, every
custom_id is in exactly one of its batch's output and error files, the database is sound."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from tests.crash.harness import Scenario

TERMINAL = ("completed", "failed", "expired", "cancelled")


@dataclass
class LiveWorker:
    """`batchmlx worker` (no --until-idle) on a scenario's $BATCHMLX_HOME."""

    s: Scenario
    proc: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(cls, s: Scenario, env: dict[str, str] | None = None, *args: str) -> LiveWorker:
        log = s.cli.home.parent / "worker.log"
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchmlx.cli", "worker", "--model", str(s.model),
             "--max-batch-size", "2", *args],
            env={**s.cli.env, **(env or {})}, cwd=s.cli.home.parent, stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        return cls(s, proc, log)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, what: str, pred: Callable[[], bool], timeout: float = 120) -> None:
        """Poll `pred` while the worker lives (a fault that killed it fails here at once)."""
        deadline = time.monotonic() + timeout
        while not pred():
            assert self.proc.poll() is None, f"worker died (rc {self.proc.returncode}):\n" + (
                self.text()
            )
            assert time.monotonic() < deadline, f"{what}: not after {timeout}s\n{self.text()}"
            time.sleep(0.05)

    def wait_all_done(self) -> None:
        self.wait_for("every batch finished", lambda: all(
            self.s.batch_row(b)["status"] in TERMINAL for b in self.s.inputs))  # fmt: skip

    def stop(self) -> int:
        """SIGTERM: a worker that survived the fault still stops cleanly (0)."""
        assert self.proc.poll() is None, f"worker died:\n{self.text()}"
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def lines_of(s: Scenario, batch_id: str) -> dict[str, list[dict]]:
    """custom_id -> its lines across the batch's output and error files."""
    row = s.batch_row(batch_id)
    seen: dict[str, list[dict]] = {}
    for key in ("output_file_id", "error_file_id"):
        if row[key]:
            for ln in (s.cli.home / "files" / row[key]).read_text().splitlines():
                obj = json.loads(ln)
                seen.setdefault(obj["custom_id"], []).append(obj)
    return seen


def check_each_once(s: Scenario, statuses: dict[str, str] | None = None) -> None:
    """Nothing lost, nothing doubled, the database sound, each batch in its expected end."""
    s.check_consistent()
    with closing(s.db()) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    for batch_id, ids in s.inputs.items():
        want = (statuses or {}).get(batch_id, "completed")
        assert s.batch_row(batch_id)["status"] == want, (batch_id, s.batch_row(batch_id))
        seen = lines_of(s, batch_id)
        assert sorted(seen) == sorted(ids), (batch_id, sorted(seen))
        assert all(len(v) == 1 for v in seen.values()), seen
