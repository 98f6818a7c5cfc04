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
from tests.e2e.helpers import make_cli


def _start(s: Scenario, log: Path, **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "batchmlx.cli", "worker", "--model", str(s.model),
         "--max-batch-size", "4"],
        env={**s.cli.env, **env}, cwd=s.cli.home.parent, stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
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


def test_sigterm_during_a_long_step_keeps_leases_and_results(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A step held (at the fault point) longer than the lease: the leases stay renewed while it
    runs (the base worker's loop stood still and they ran out), the SIGTERM is taken at once,
    and when the step ends its results are written and the rest given back: no row is left
    `running`."""
    s = Scenario.new(tmp_path, tiny_model_dir, batches=1, per_batch=8, max_tokens=4)
    pause = tmp_path / "pause"
    pause.mkdir()
    log = tmp_path / "w.log"
    proc = _start(s, log, BATCHMLX_PAUSE_AT="engine_step:4", BATCHMLX_PAUSE_DIR=str(pause),
                  BATCHMLX_LEASE_S="3")  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (pause / "engine_step.reached").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        time.sleep(4.5)  # one and a half leases into the held step
        with closing(s.db()) as conn:
            leases = [r[0] for r in conn.execute(
                "SELECT lease_expires_at FROM requests WHERE status = 'running'")]  # fmt: skip
        assert leases and min(leases) > time.time(), (leases, time.time())
        assert proc.poll() is None  # the step it is in still runs
        (pause / "engine_step.go").touch()
        t0 = time.monotonic()
        assert proc.wait(timeout=30) == 0, log.read_text()
        assert time.monotonic() - t0 < 10
    finally:
        (pause / "engine_step.go").touch()
        if proc.poll() is None:
            proc.kill()
    assert "Traceback" not in log.read_text()
    st = _statuses(s)
    assert "running" not in st and st.get("succeeded", 0) >= 1, st
    assert st.get("succeeded", 0) + st.get("queued", 0) == 8, st
    s.check_consistent()


def test_sigterm_to_an_idle_worker_on_postgresql_exits_at_once(tmp_path: Path, pg_url: str) -> None:
    """The idle wait (a LISTEN of up to lease_s / 3) is woken by the stop: the base worker
    took 6-14 s."""
    import asyncio

    from batchmlx.config import load_settings
    from batchmlx.store import Store

    home = tmp_path / "home"
    home.mkdir()
    env = {**make_cli(tmp_path).env, "BATCHMLX_DATABASE_URL": pg_url}
    log = tmp_path / "w.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchmlx.cli", "worker"], env=env, cwd=tmp_path,
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip

    async def registered() -> bool:
        store = await Store.from_settings(load_settings(env))
        try:
            return bool(await store.live_workers(time.time() + 60, 3600))
        finally:
            await store.close()

    try:
        deadline = time.monotonic() + 60
        while not asyncio.run(registered()):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        time.sleep(1.0)  # into the idle wait
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log.read_text()
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert took < 2.5, f"{took:.1f}s to stop an idle worker"
