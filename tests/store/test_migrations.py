"""The schema comes from Alembic, on first open, and equals the declarative models."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine

from batchmlx.store.migrate import alembic_config, head_revision, upgrade_to_head
from batchmlx.store.models import Base

REPO = Path(__file__).resolve().parents[2]


def _head() -> str:
    return ScriptDirectory.from_config(alembic_config("unused.db")).get_current_head()


def _schema(path: Path) -> list[tuple[str, str, str, str]]:
    with sqlite3.connect(path) as conn:
        rows = conn.execute(
            "SELECT type, name, tbl_name, sql FROM sqlite_master "
            "WHERE name NOT LIKE 'alembic_version%' AND name NOT LIKE 'sqlite_%'"
        ).fetchall()
    return sorted((t, n, tbl, " ".join((sql or "").split())) for t, n, tbl, sql in rows)


@pytest.mark.dialects("sqlite")
def test_open_creates_parent_folder_and_migrates_to_head(with_store, db_path):
    assert not db_path.parent.exists()
    with_store(lambda store: store.pragmas())
    with sqlite3.connect(db_path) as conn:
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(_head(),)]
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    assert {"files", "batches", "requests", "workers"} <= tables
    with_store(lambda store: store.pragmas())  # opening again is a no-op


def test_the_head_read_from_the_files_is_alembics() -> None:
    assert head_revision() == _head()


def test_a_database_at_head_is_opened_without_alembic(tmp_path, monkeypatch):
    from alembic import command

    db = tmp_path / "at_head.db"
    upgrade_to_head(db)
    calls: list[str] = []
    monkeypatch.setattr(command, "upgrade", lambda cfg, rev: calls.append(rev))
    upgrade_to_head(db)  # at head: no Alembic
    assert calls == []
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE alembic_version SET version_num = '0002'")
    upgrade_to_head(db)  # behind: Alembic upgrades it
    assert calls == ["head"]


def test_migrated_schema_equals_models(tmp_path):
    migrated, declared = tmp_path / "migrated.db", tmp_path / "declared.db"
    upgrade_to_head(migrated)
    engine = create_engine(f"sqlite:///{declared}")
    Base.metadata.create_all(engine)
    engine.dispose()

    engine = create_engine(f"sqlite:///{migrated}")
    with engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn, opts={"compare_type": True, "compare_server_default": True}
        )
        assert compare_metadata(ctx, Base.metadata) == []
    engine.dispose()

    assert _schema(migrated) == _schema(declared)


def test_concurrent_first_open_by_several_processes(tmp_path):
    db = tmp_path / "fresh" / "batchmlx.db"
    code = (
        "import asyncio, sys\n"
        "from batchmlx.store import Store\n"
        "async def main():\n"
        "    store = await Store.open(sys.argv[1])\n"
        "    await store.heartbeat(sys.argv[2], now=1.0, lease_s=1.0)\n"
        "    await store.close()\n"
        "asyncio.run(main())\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(db), f"w{i}"],
            cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM workers").fetchone() == (4,)
        assert conn.execute("SELECT version_num FROM alembic_version").fetchall() == [(_head(),)]


def _pg_diff(url: str) -> list:
    """Differences between a PostgreSQL database and the declarative models, ignoring only the
    `seq` columns migration 0002 adds there in place of SQLite's rowid."""
    import asyncio

    from sqlalchemy.ext.asyncio import create_async_engine

    def hidden_seq(obj, name, type_, reflected, compare_to) -> bool:
        return not (type_ == "column" and name == "seq" and reflected and compare_to is None)

    def diff(conn) -> list:
        opts = {"compare_type": True, "compare_server_default": True,
                "include_object": hidden_seq}  # fmt: skip
        return compare_metadata(MigrationContext.configure(conn, opts=opts), Base.metadata)

    async def main() -> list:
        engine = create_async_engine(url)
        try:
            async with engine.connect() as conn:
                return await conn.run_sync(diff)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def test_postgresql_migrated_schema_equals_models(pg_url):
    upgrade_to_head(pg_url)
    assert _pg_diff(pg_url) == []
    upgrade_to_head(pg_url)  # again: a no-op


def test_concurrent_first_open_of_postgresql_by_several_processes(pg_url):
    from .conftest import fetch_rows

    code = (
        "import asyncio, sys\n"
        "from batchmlx.store import Store\n"
        "async def main():\n"
        "    store = await Store.open(sys.argv[1])\n"
        "    await store.heartbeat(sys.argv[2], now=1.0, lease_s=1.0)\n"
        "    await store.close()\n"
        "asyncio.run(main())\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, pg_url, f"w{i}"],
            cwd=REPO,
            env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    assert fetch_rows(pg_url, "SELECT count(*) FROM workers") == [(4,)]
    assert fetch_rows(pg_url, "SELECT version_num FROM alembic_version") == [(_head(),)]


def test_a_database_made_by_0001_upgrades_with_its_rows(store_target):
    """Existing queues move to 0002 in place: rows kept, insertion order kept (PostgreSQL's
    new `seq` numbers old rows too)."""
    import asyncio

    from alembic import command

    from batchmlx.store import Store

    from .conftest import execute_sql, fetch_rows

    if isinstance(store_target, Path):
        store_target.parent.mkdir(parents=True)
    command.upgrade(alembic_config(store_target), "0001")
    for i, created in enumerate((100, 100, 50)):
        execute_sql(store_target, (
            "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, "
            f"created_at) VALUES ('batch_{i}', '/v1/chat/completions', 'file-x', '24h', "
            f"'completed', {created})"
        ))  # fmt: skip

    async def listed() -> list[str]:
        store = await Store.open(store_target)
        try:
            return [b.id for b in await store.list_batches()]
        finally:
            await store.close()

    assert asyncio.run(listed()) == ["batch_1", "batch_0", "batch_2"]
    assert fetch_rows(store_target, "SELECT version_num FROM alembic_version") == [(_head(),)]


def test_0004_gives_existing_batches_priority_0_and_claims_by_it(store_target):
    """Batches made before 0004 read priority 0; a new batch's priority is stored and read."""
    import asyncio

    from alembic import command

    from batchmlx.store import Store

    from .conftest import execute_sql

    if isinstance(store_target, Path):
        store_target.parent.mkdir(parents=True)
    command.upgrade(alembic_config(store_target), "0003")
    execute_sql(store_target, (
        "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, "
        "created_at) VALUES ('batch_old', '/v1/chat/completions', 'file-x', '24h', "
        "'in_progress', 100)"
    ))  # fmt: skip

    async def read() -> tuple[int, list[tuple[str, int]]]:
        store = await Store.open(store_target)
        try:
            old = await store.get_batch("batch_old")
            assert old is not None
            return old.priority, [(b.id, b.priority) for b in await store.active_batches()]
        finally:
            await store.close()

    assert asyncio.run(read()) == (0, [("batch_old", 0)])
