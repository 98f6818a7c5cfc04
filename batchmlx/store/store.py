"""The store: every SQL operation batchmlx performs, as named methods of one class, `Store`.

`Store` is composed of one part per concept, each its own module sharing one engine (base.py):
the queue (queue.py: claims, leases, heartbeats, fenced completion, release, workers, wake-ups),
files (files.py: records and bytes), batches (batches.py: records, status moves, results),
enqueueing (enqueue.py); rows ↔ records are mapped once (rows.py), and where SQLite and
PostgreSQL differ is said once (dialects.py).

One class for SQLite (the embedded default) and PostgreSQL (several hosts, one queue). On SQLite,
writes run in `BEGIN IMMEDIATE` transactions (see connection.py), so concurrent worker processes
queue up on the write lock instead of failing; reads run in deferred transactions and, under WAL,
never wait for a writer. On PostgreSQL, claims lock rows with `FOR UPDATE SKIP LOCKED`, so
workers never wait on each other, and idle workers wait on `LISTEN/NOTIFY`. Time, ids and lease
lengths come in as arguments; `clock()` is the database's clock on PostgreSQL.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

from sqlalchemy.exc import DBAPIError

from batchmlx.config import Settings, private_dir, private_file
from batchmlx.database_url import Target, parse_target
from batchmlx.store.batches import BatchesPart
from batchmlx.store.connection import DEFAULT_BUSY_TIMEOUT_S
from batchmlx.store.dialects import create_engine
from batchmlx.store.enqueue import Enqueue, EnqueuePart
from batchmlx.store.files import FilesPart
from batchmlx.store.migrate import upgrade_to_head
from batchmlx.store.queue import QueuePart
from batchmlx.store.retention import RetentionPart
from batchmlx.store.types import FileStorage, StoreUnavailable

__all__ = ["Enqueue", "Store"]


class Store(QueuePart, FilesPart, BatchesPart, EnqueuePart, RetentionPart):
    """The seam between batchmlx and its database. Open with `await Store.open(path or URL)`."""

    @classmethod
    async def open(
        cls,
        target: str | Path | Target,
        *,
        files_dir: Path | None = None,
        files: FileStorage | None = None,
        busy_timeout_s: float = DEFAULT_BUSY_TIMEOUT_S,
    ) -> Store:
        """Open a SQLite file (a path or sqlite:/// URL; its folder is created) or a PostgreSQL
        URL, and apply pending migrations. File bytes go to `files` (default: local files under
        `files_dir`, by default the SQLite file's folder/files, on SQLite; the database on
        PostgreSQL)."""
        t = parse_target(target)
        if t.is_postgresql and importlib.util.find_spec("asyncpg") is None:
            raise RuntimeError("PostgreSQL needs asyncpg: pip install 'batchmlx[postgres]'")
        if t.is_sqlite:
            assert t.path is not None
            # the database holds every prompt and answer: the user's alone (0700 / 0600)
            private_file(private_dir(t.path.parent) / t.path.name)
            files_dir = files_dir or t.path.parent / "files"
        default = FileStorage.DATABASE if t.files_in_database else FileStorage.LOCAL
        try:
            await asyncio.to_thread(upgrade_to_head, t)
        except (OSError, DBAPIError) as exc:
            raise StoreUnavailable(f"cannot open the database {t.display}: {exc}") from exc
        engine = create_engine(t, busy_timeout_s)
        store = cls(engine, t.dialect, path=t.path, files=files or default, files_dir=files_dir)
        await store.sync_clock()
        return store

    @classmethod
    async def from_settings(cls, settings: Settings) -> Store:
        """The store `settings` (batchmlx.config.Settings) name: database URL and file place."""
        files = FileStorage.DATABASE if settings.files_in_database else FileStorage.LOCAL
        timeout = settings.busy_timeout_s
        busy = {} if timeout is None else {"busy_timeout_s": timeout}
        return await cls.open(settings.target, files_dir=settings.files_dir, files=files, **busy)

    async def close(self) -> None:
        if self._listener is not None:
            await self._listener.close()
        await self._engine.dispose()

    async def pragmas(self) -> dict[str, Any]:
        """The connection settings in force (SQLite; for diagnostics and tests)."""
        return await self._sql.pragmas(self._reader)
