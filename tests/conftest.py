"""Suite-wide set-up and fixtures shared by the test layers."""

from __future__ import annotations

from pathlib import Path

import pytest

# Test tiers: `pytest -m "not slow"` is the inner loop (pure logic, the store on real SQLite and
# PostgreSQL, the engine on tiny random-weight models); the README's command runs everything.
# Slow: whole processes (CLI, workers, crashes, several hosts, a browser, built wheels) and the
# real default model.
SLOW_LAYERS = frozenset({"e2e", "crash", "faults", "multihost", "browser"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tests_dir = Path(__file__).resolve().parent
    for item in items:
        layer = Path(item.fspath).resolve().relative_to(tests_dir).parts[0]
        if layer in SLOW_LAYERS or item.get_closest_marker("real_model"):
            item.add_marker(pytest.mark.slow)


def pytest_configure(config) -> None:
    # MLX's Linux CPU wheel links a reference BLAS; batchmlx loads an optimized one ahead of
    # MLX (engine/host/fast_blas.py). Do the same for pytest, before any test imports MLX, so
    # the engine tests run at the speed users get. No-op where none is found.
    from batchmlx.engine.host.fast_blas import ensure_fast_blas

    ensure_fast_blas()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight 2-layer llama MLX folder with the real tokenizer (see tests/tiny_model)."""
    from tests.e2e.helpers import model_cache_dir
    from tests.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", model_cache_dir())


@pytest.fixture(scope="session")
def pg_server():
    """A PostgreSQL server for the session (tests/pg_server.py). On CI ($CI set) a server that
    cannot start fails the tests; elsewhere they are skipped, saying why."""
    import os

    from tests.pg_server import PgUnavailable, start_postgres

    try:
        server = start_postgres()
    except PgUnavailable as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"no PostgreSQL for these tests: {exc}")
    yield server
    server.stop()


@pytest.fixture
def pg_url(pg_server) -> str:
    """A fresh, empty PostgreSQL database for one test."""
    return pg_server.new_database()


DIALECTS = ("sqlite", "postgresql")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking `dialect` (or `store_target`) runs once per dialect; the marker
    `@pytest.mark.dialects("sqlite")` keeps it to those it names."""
    if "dialect" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("dialects")
        metafunc.parametrize("dialect", marker.args if marker else DIALECTS)


@pytest.fixture
def store_target(dialect: str, tmp_path: Path, request: pytest.FixtureRequest) -> str | Path:
    """What `Store.open` takes: a SQLite file under tmp_path, or a fresh PostgreSQL database."""
    if dialect == "sqlite":
        return tmp_path / "state" / "batchmlx.db"
    return request.getfixturevalue("pg_url")


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight LLaVA folder built from mlx-vlm's own classes (see tests/tiny_vlm)."""
    pytest.importorskip("mlx_vlm", reason="the vision extra (mlx-vlm) is not installed")
    from tests.e2e.helpers import model_cache_dir
    from tests.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny-llava", model_cache_dir())


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Qwen2-VL folder (images and videos, M-RoPE; see tests/tiny_vlm)."""
    pytest.importorskip("mlx_vlm", reason="the vision extra (mlx-vlm) is not installed")
    pytest.importorskip("av", reason="the vision extra (PyAV) is not installed")
    from tests.e2e.helpers import model_cache_dir
    from tests.tiny_vlm import build_tiny_qwen2_vl

    dest = tmp_path_factory.mktemp("vlm") / "tiny-qwen2-vl"
    return build_tiny_qwen2_vl(dest, model_cache_dir())
