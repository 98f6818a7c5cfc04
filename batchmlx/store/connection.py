"""SQLite connection setup: WAL, busy timeout, and transactions that take the write lock up front.

pysqlite (and aiosqlite on top of it) emits its own deferred BEGIN lazily; we turn that off and
emit BEGIN ourselves (SQLAlchemy's documented recipe), so a write transaction starts with
`BEGIN IMMEDIATE`. A deferred transaction that later writes cannot wait on a busy WAL writer and
fails with "database is locked" at once; an immediate one waits up to busy_timeout instead.
Connections opened with the execution option `begin="DEFERRED"` start plain read transactions.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.engine import Connection

DEFAULT_BUSY_TIMEOUT_S = 30.0
BEGIN_OPTION = "begin"  # execution option: "IMMEDIATE" (the default) or "DEFERRED"


def install_sqlite_setup(engine: Engine, busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S) -> None:
    """Attach the pragma and BEGIN listeners to a sync engine (or an async engine's sync_engine)."""
    busy_ms = int(busy_timeout_s * 1000)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # autocommit at the driver; we emit BEGIN
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout = {busy_ms}")
            cursor.execute("PRAGMA journal_mode = WAL")
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        mode = conn.get_execution_options().get(BEGIN_OPTION, "IMMEDIATE")
        conn.exec_driver_sql("BEGIN IMMEDIATE" if mode == "IMMEDIATE" else "BEGIN DEFERRED")
