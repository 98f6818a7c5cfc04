"""End-to-end fixtures: the real CLI in subprocesses, real SQLite, the real default model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.helpers import Cli, make_cli


@pytest.fixture
def cli(tmp_path: Path) -> Cli:
    """The CLI against a fresh $BATCHMLX_HOME under this test's tmp_path."""
    return make_cli(tmp_path)
