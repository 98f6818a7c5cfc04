"""The console script's entry: which command lines move onto the fast BLAS (a re-execution,
about 0.5 s), and its quick exit keeping output and exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchmlx.accel import REEXEC_MARKER, reexec_env
from batchmlx.cli import runs_model


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["submit", "f.jsonl", "--wait"], True),
        (["submit", "f.jsonl"], False),
        (["submit", "f.jsonl", "--wait", "--no-wait"], False),
        (["submit", "--no-wait", "f.jsonl", "--wait"], True),
        (["worker", "--until-idle"], True),
        (["serve"], True),
        (["doctor"], True),
        (["results", "batch_1", "-o", "out.jsonl"], False),
        (["status"], False),
        (["list", "--json"], False),
        (["cancel", "batch_1"], False),
        (["watch", "inbox"], False),
        (["--database-url", "sqlite:///x.db", "results", "b"], False),
        (["--database-url", "sqlite:///x.db", "worker"], True),
        (["--database-url=sqlite:///x.db", "submit", "f", "--wait"], True),
        (["--help"], False),
        ([], False),
        (["some-new-command"], True),  # unknown: as before, re-executed
    ],
)
def test_only_commands_that_may_run_a_model_reexecute(argv, expected):
    assert runs_model(argv) is expected


# Prints a line each time the interpreter starts: twice when the CLI re-executes itself.
_ENTRY = "print('started', flush=True); from batchmlx.cli import main; main()"


def _cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (REEXEC_MARKER, "LD_PRELOAD")}
    env.update(BATCHMLX_HOME=str(home), PYTHONPATH=str(Path(__file__).parents[2]))
    return subprocess.run([sys.executable, "-c", _ENTRY, *args], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def test_results_and_list_run_without_reexecuting(tmp_path: Path) -> None:
    if reexec_env({}) is None:
        pytest.skip("no fast BLAS to re-execute onto here")
    listed = _cli(tmp_path, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout == "started\n[]\n"  # one start; the output complete at the quick exit
    missing = _cli(tmp_path, "results", "batch_nope")
    assert missing.stdout == "started\n"
    assert missing.returncode == 1 and "batch_nope" in missing.stderr
    doctor = _cli(tmp_path, "doctor", "--no-measure")
    assert doctor.returncode == 0, doctor.stderr
    assert doctor.stdout.count("started") == 2  # a model command still re-executes


def test_a_fast_exit_waits_only_for_threads_that_may_be_working() -> None:
    """The engine's idle host-kernel pool and daemon threads do not keep the CLI on the slow
    exit (interpreter teardown); any other live thread does."""
    import threading

    from batchmlx.cli import _working_threads
    from batchmlx.engine.kernels import host_attention

    host_attention.workers().submit(lambda: None).result()  # the pool's threads are alive
    pool = [t for t in threading.enumerate() if t.name.startswith(host_attention.THREAD_NAME)]
    assert pool and not set(pool) & set(_working_threads())
    release = threading.Event()
    daemon = threading.Thread(target=release.wait, daemon=True)
    other = threading.Thread(target=release.wait, name="writer")
    daemon.start()
    other.start()
    try:
        working = _working_threads()
        assert other in working and daemon not in working
    finally:
        release.set()
        daemon.join()
        other.join()
