"""The built wheel carries everything a user's install needs at run time (no checkout around it)."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.e2e.helpers import cli_env, venv_seeing_this_python

REPO = Path(__file__).resolve().parents[2]


# the README's main job, as .ci/wheel-check runs it from an empty folder
MAIN_JOB = "batchmlx submit --example --wait"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
         "-w", str(out), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    [built] = out.glob("batchmlx-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_names(wheel: Path) -> set[str]:
    return set(zipfile.ZipFile(wheel).namelist())


def test_wheel_ships_the_migrations(wheel_names: set[str]) -> None:
    versions = sorted(p.name for p in (REPO / "migrations" / "versions").glob("*.py"))
    expected = {"batchmlx/migrations/env.py", "batchmlx/migrations/script.py.mako"}
    expected |= {f"batchmlx/migrations/versions/{name}" for name in versions}
    assert expected <= wheel_names


def test_installed_migrations_are_found() -> None:
    from batchmlx.store.migrate import MIGRATIONS_DIR

    assert (MIGRATIONS_DIR / "env.py").is_file()
    assert any((MIGRATIONS_DIR / "versions").glob("0001_*.py"))


def test_wheel_ships_the_dashboard(wheel_names: set[str]) -> None:
    static = sorted(p.name for p in (REPO / "batchmlx" / "server" / "static").iterdir())
    assert {"index.html", "dashboard.js", "dashboard.css"} <= set(static)
    assert {f"batchmlx/server/static/{name}" for name in static} <= wheel_names


def test_wheel_ships_the_examples(wheel_names: set[str]) -> None:
    names = sorted(p.name for p in (REPO / "jobs" / "examples").glob("*.jsonl"))
    assert "chat.jsonl" in names
    assert {f"batchmlx/examples/{name}" for name in names} <= wheel_names


def test_the_readme_main_job_is_what_wheel_check_runs() -> None:
    """.ci/wheel-check runs the README's main job word for word, from an empty folder."""
    readme = (REPO / "README.md").read_text()
    assert f"pip install -e . && {MAIN_JOB}" in readme  # a fresh clone
    assert f"pip install batchmlx-0.1.0-py3-none-any.whl && {MAIN_JOB}" in readme  # a wheel
    check = (REPO / ".ci" / "wheel-check").read_text().splitlines()
    assert MAIN_JOB in check  # a line of its own, as a user types it
    assert check.index(MAIN_JOB) > check.index('mkdir "$work/empty" && cd "$work/empty"')


def test_the_wheel_installed_example_job_runs_from_an_empty_folder(
    wheel: Path, tmp_path: Path, tiny_model_dir: Path
) -> None:
    """The wheel in a virtual environment of its own (its dependencies seen from this
    Python's site-packages, however this Python was installed, so nothing is downloaded), no
    checkout on any path: the example ships inside it. The tiny model stands in for the default
    one (wheel-check runs that)."""
    venv = tmp_path / "venv"
    python = venv_seeing_this_python(venv)
    # --ignore-installed: this Python may hold batchmlx itself (an editable install)
    pip = [str(python), "-m", "pip", "install", "-q", "--no-deps",
           "--ignore-installed", "--no-index", "--disable-pip-version-check",
           str(wheel)]  # fmt: skip
    subprocess.run(pip, check=True, capture_output=True, timeout=300)
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {k: v for k, v in cli_env(tmp_path / "home").items() if k != "PYTHONPATH"}
    where = subprocess.run([str(venv / "bin" / "batchmlx"), "example", "--path"], cwd=empty,
                           env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert where.returncode == 0, where.stderr
    assert Path(where.stdout.strip()).is_relative_to(venv), where.stdout  # the wheel's copy
    proc = subprocess.run(
        [str(venv / "bin" / "batchmlx"), *MAIN_JOB.split()[1:], "--json", "--model",
         str(tiny_model_dir)],
        cwd=empty, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    batch = json.loads(proc.stdout)
    assert batch["status"] == "completed" and batch["request_counts"]["total"] == 8
    assert list(empty.iterdir()) == []
