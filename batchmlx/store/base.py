"""What every part of the store shares: the engine (writes) and its reader (reads), the dialect's
SQL, where file bytes live, and the lease clock."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sqlalchemy import and_, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from batchmlx.database_url import Dialect
from batchmlx.store.blobs import Blobs, DatabaseBlobs, LocalBlobs
from batchmlx.store.connection import BEGIN_OPTION
from batchmlx.store.dialects import DialectSQL, sql_for
from batchmlx.store.types import FileStorage


async def rows_after(
    conn: AsyncConnection, table: Any, seq: Any, after: str, *, desc: bool
) -> Any | None:
    """Keyset paging: the condition for the rows after row `after` in (created_at, insertion
    order), newest first when `desc`; None when `after` is unknown."""
    cursor = (
        await conn.execute(select(table.c.created_at, seq).where(table.c.id == after))
    ).first()
    if cursor is None:
        return None
    created, at = cursor
    if desc:
        return or_(table.c.created_at < created, and_(table.c.created_at == created, seq < at))
    return or_(table.c.created_at > created, and_(table.c.created_at == created, seq > at))


class StoreBase:
    """The state the store's parts (queue, files, batches) work on; see `Store`."""

    def __init__(
        self,
        engine: AsyncEngine,
        dialect: Dialect,
        *,
        path: Path | None = None,
        files: FileStorage = FileStorage.LOCAL,
        files_dir: Path | None = None,
    ) -> None:
        self.path = path  # the SQLite file (None on PostgreSQL)
        self.dialect = dialect
        self._sql: DialectSQL = sql_for(dialect, path)
        self._engine = engine  # SQLite: transactions begin IMMEDIATE; use for anything that writes
        self._reader = engine.execution_options(**{BEGIN_OPTION: "DEFERRED"})
        self._listener = self._sql.listener(engine)
        self.files = files
        if files is FileStorage.DATABASE:
            self.blobs: Blobs = DatabaseBlobs(engine, self._reader)
        else:
            if files_dir is None:
                raise ValueError("local file storage needs a folder")
            self.blobs = LocalBlobs(files_dir)
        # the database's clock, read at open and at each heartbeat, advanced by this host's
        # monotonic clock in between (a host's wall clock can be wrong or jump)
        self._db_epoch: float | None = None
        self._mono = 0.0

    def clock(self) -> float:
        """Now, in unix seconds, as leases must be stamped: the database's clock on PostgreSQL
        (hosts' clocks differ), this host's on SQLite (one host)."""
        if self._db_epoch is None:
            return time.time()
        return self._db_epoch + (time.monotonic() - self._mono)

    async def sync_clock(self, conn: AsyncConnection | None = None) -> None:
        """Read the database's clock (PostgreSQL; a no-op on SQLite)."""
        query = self._sql.clock_query
        if query is None:
            return
        if conn is None:
            async with self._reader.connect() as c:
                epoch = (await c.execute(query)).scalar_one()
        else:
            epoch = (await conn.execute(query)).scalar_one()
        self._db_epoch, self._mono = float(epoch), time.monotonic()

    @property
    def one_host(self) -> bool:
        """SQLite: every process of this store runs on this host, so a registered worker's PID
        says whether it is alive. Not so across hosts (nor PID namespaces): there, leases."""
        return self.dialect is Dialect.SQLITE
