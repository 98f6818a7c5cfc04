"""The console script's entry: which command lines move onto the fast BLAS (loaded in process,
or a re-execution where it cannot be), the database URL carried through a re-execution in argv,
its quick exit keeping output and exit codes; and the engine options the model commands
share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchmlx.cli import app, runs_model
from batchmlx.cli.engine_options import engine_choice
from batchmlx.core.engine_api import ENGINE_DEFAULTS
from batchmlx.engine.host.fast_blas import REEXEC_MARKER, reexec_env


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
# MLX imported before the entry: too late to load the BLAS in process, so it re-executes
_LATE = "print('started', flush=True); import mlx.core; from batchmlx.cli import main; main()"


def _cli(home: Path, *args: str, entry: str = _ENTRY) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (REEXEC_MARKER, "LD_PRELOAD")}
    env.update(BATCHMLX_HOME=str(home), PYTHONPATH=str(Path(__file__).parents[2]))
    return subprocess.run([sys.executable, "-c", entry, *args], env=env, capture_output=True,
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
    assert doctor.stdout.count("started") == 1  # a model command loads it in process
    assert "loaded in this process" in doctor.stdout
    late = _cli(tmp_path, "doctor", "--no-measure", entry=_LATE)
    assert late.returncode == 0, late.stderr
    assert late.stdout.count("started") == 2  # where it cannot, it re-executes
    assert "re-executed by batchmlx" in late.stdout


def test_the_database_url_after_the_command_survives_the_reexecution(tmp_path: Path) -> None:
    """The URL is passed down in Settings, not the environment: the re-executed process parses
    the same command line again."""
    if reexec_env({}) is None:
        pytest.skip("no fast BLAS to re-execute onto here")
    db = tmp_path / "elsewhere.db"
    done = _cli(tmp_path / "home", "worker", "--until-idle", "--database-url", f"sqlite:///{db}",
                entry=_LATE)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("started") == 2  # re-executed
    assert db.is_file() and not (tmp_path / "home" / "batchmlx.db").exists()


def test_status_loads_no_mlx(tmp_path: Path) -> None:
    code = (
        "import sys; from batchmlx.cli import app; app(['status'], standalone_mode=False); "
        "print([m for m in ('mlx', 'mlx_lm', 'batchmlx.engine') if m in sys.modules])"
    )
    env = dict(os.environ, BATCHMLX_HOME=str(tmp_path), PYTHONPATH=str(Path(__file__).parents[2]))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["no batches", "[]"]


def _engine_flags(command: str) -> set[str]:
    import typer.main

    group = typer.main.get_command(app)
    params = group.commands[command].params  # type: ignore[attr-defined]
    return {o for p in params if getattr(p, "rich_help_panel", None) == "Engine options"
            for o in p.opts}  # fmt: skip


def test_worker_serve_and_submit_share_the_engine_options() -> None:
    flags = _engine_flags("worker")
    assert {"--simple", "--max-batch-size", "--cache-memory-percent", "--memory-aware-cache",
            "--cache-max-blocks", "--dtype"} <= flags  # fmt: skip
    assert _engine_flags("serve") == flags == _engine_flags("submit")


def test_serve_hands_the_cache_options_and_the_url_to_the_server(monkeypatch, tmp_path) -> None:
    from typer.testing import CliRunner

    import batchmlx.server.app

    seen = {}

    def serve(settings, options, **_kw) -> None:
        seen.update(s=settings, o=options)

    monkeypatch.setattr(batchmlx.server.app, "serve", serve)
    monkeypatch.setenv("BATCHMLX_HOME", str(tmp_path))
    monkeypatch.delenv("BATCHMLX_DATABASE_URL", raising=False)
    url = f"sqlite:///{tmp_path / 'q.db'}"
    done = CliRunner().invoke(app, ["--database-url", url, "serve", "--no-memory-aware-cache",
                                    "--cache-max-blocks", "100", "--dtype", "float32"])  # fmt: skip
    assert done.exit_code == 0, done.output
    assert seen["s"].database_url == url
    assert "BATCHMLX_DATABASE_URL" not in os.environ  # passed down, not through the environment
    worker = seen["o"].worker
    assert worker.dtype == "float32"
    assert not worker.engine.memory_aware and worker.engine.cache_max_blocks == 100


def test_engine_option_defaults_are_the_engine_defaults() -> None:
    chosen = engine_choice()
    assert chosen.settings == ENGINE_DEFAULTS and chosen.dtype == "auto"
    off = engine_choice(memory_aware_cache=False, cache_max_blocks=7)
    assert not off.settings.memory_aware and off.settings.cache_max_blocks == 7


def test_a_fast_exit_waits_only_for_threads_that_may_be_working() -> None:
    """The engine's idle host-kernel pool and daemon threads do not keep the CLI on the slow
    exit (interpreter teardown); any other live thread does."""
    import threading

    from batchmlx.cli.entry import _working_threads
    from batchmlx.engine.host import backend

    backend.current().pool().submit(lambda: None).result()  # the pool's threads are alive
    pool = [t for t in threading.enumerate() if t.name.startswith(backend.THREAD_NAME)]
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
