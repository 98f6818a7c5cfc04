"""Stopping is not failing: a worker stopped gracefully (SIGTERM) gives its requests back
without spending their attempts, so stopping it again and again never fails a request that
never crashed ("gave up after 3 attempts" is for runs that died)."""

from __future__ import annotations

import signal
from contextlib import closing
from pathlib import Path

from tests.crash.harness import Scenario, run_ok
from tests.faults.harness import LiveWorker


def _succeeded(s: Scenario) -> int:
    with closing(s.db()) as conn:
        return conn.execute("SELECT COUNT(*) FROM requests WHERE status='succeeded'").fetchone()[0]


def test_sigterm_many_times_gives_up_nothing(tmp_path: Path, tiny_model_dir: Path) -> None:
    # long generations, 2 in the engine and 8 claimed per run: the middle requests are claimed
    # by every one of the stopped runs
    s = Scenario.new(tmp_path, tiny_model_dir, batches=1, per_batch=12, max_tokens=100)
    for _ in range(4):  # more graceful stops than --max-attempts
        before = _succeeded(s)
        w = LiveWorker.start(s, None, "--max-attempts", "3")
        try:
            w.wait_for("one more result", lambda b=before: _succeeded(s) > b)
            w.proc.send_signal(signal.SIGTERM)
            assert w.proc.wait(timeout=60) == 0, w.text()
        finally:
            w.kill()
        s.check_consistent()
    run_ok(s.worker(None, "--max-attempts", "3"))
    (obj,) = s.check_done().values()
    assert obj["request_counts"] == {"total": 12, "completed": 12, "failed": 0}
    # no run of any request ended in a crash: each ran to completion on its one counted attempt
    assert set(s.attempts().values()) == {1}
