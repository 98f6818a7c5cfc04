"""SIGTERM: the worker finishes its step, gives back its leases and exits 0; a second SIGTERM
exits at once (130). A later worker finishes the batch, re-running only what was given back."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

from tests.crash.harness import Scenario, run_ok


def _start(s: Scenario, log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "batchmlx.cli", "worker", "--model", str(s.model),
         "--max-batch-size", "4"],
        env=s.cli.env, cwd=s.cli.home.parent, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def _wait_running(s: Scenario, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        with closing(s.db()) as conn:
            n = conn.execute("SELECT COUNT(*) FROM requests WHERE status='succeeded'").fetchone()
        if n[0] > 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"no request finished in 60s:\n{log.read_text()}")


def _statuses(s: Scenario) -> dict[str, int]:
    with closing(s.db()) as conn:
        return dict(conn.execute("SELECT status, COUNT(*) FROM requests GROUP BY status"))


def test_sigterm_then_double_sigterm(tmp_path: Path, tiny_model_dir: Path) -> None:
    # long generations (a random model rarely stops early): the batch outlives the signals
    s = Scenario.new(tmp_path, tiny_model_dir, batches=1, per_batch=8, max_tokens=150)

    log = tmp_path / "w1.log"
    proc = _start(s, log)
    _wait_running(s, proc, log)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log.read_text()
    assert "Traceback" not in log.read_text()
    st = _statuses(s)
    assert "running" not in st and st.get("queued", 0) > 0, st  # leases given back
    with closing(s.db()) as conn:
        assert conn.execute("SELECT COUNT(*) FROM workers").fetchone() == (0,)
    s.check_consistent()

    log2 = tmp_path / "w2.log"
    proc = _start(s, log2)
    _wait_running(s, proc, log2)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    t0 = time.monotonic()
    # 130 from the handler's os._exit; -SIGTERM if the first one had already shut the loop
    assert proc.wait(timeout=10) in (130, -signal.SIGTERM), log2.read_text()
    assert time.monotonic() - t0 < 5
    s.check_consistent()

    # the second worker died holding leases: the next one takes them over at once (dead pid)
    run_ok(s.worker(None, "--max-attempts", "5"))
    (obj,) = s.check_done().values()
    assert obj["request_counts"] == {"total": 8, "completed": 8, "failed": 0}
