"""The built wheel carries everything a user's install needs at run time (no checkout around it)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
         "-w", str(out), str(REPO)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    [wheel] = out.glob("batchmlx-*.whl")
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
