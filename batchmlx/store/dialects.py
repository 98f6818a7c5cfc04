"""Everything that differs between SQLite and PostgreSQL, in one place: engines, insertion order,
claim locking, the fenced bulk complete, wake-ups, the database clock and per-batch locks.

The parts of the store (queue.py, files.py, batches.py) write portable SQLAlchemy and ask
`self._sql` (a `SQLiteSQL` or `PostgresSQL`) where the dialects part ways.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, literal_column, text, update
from sqlalchemy.dialects import postgresql
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine
from sqlalchemy.sql import Select

from batchmlx.core.records import RequestResult
from batchmlx.database_url import Dialect, Target
from batchmlx.store.connection import install_sqlite_setup
from batchmlx.store.listen import Listener
from batchmlx.store.locks import lock_path, try_lock, unlock
from batchmlx.store.rows import PER_ROW, RUNNING, SAME_FOR_ALL, R, result_values

WORK_CHANNEL = "batchmlx_work"  # NOTIFY'd when there may be new work to claim
_LOCK_SPACE = 0x626D6C79  # advisory lock key space of per-batch locks (finalize)
# server settings of every PostgreSQL session: a host that vanishes without closing its socket
# loses its connection (and the advisory locks it held) within about a minute
_PG_SESSION = {"tcp_keepalives_idle": "30", "tcp_keepalives_interval": "10",
               "tcp_keepalives_count": "3"}  # fmt: skip

Finished = Callable[[], Awaitable[bool]]  # whether a batch is finished (batch_lock's cleanup)


def create_engine(target: Target, busy_timeout_s: float) -> AsyncEngine:
    if target.is_sqlite:
        engine = create_async_engine(target.url)
        install_sqlite_setup(engine.sync_engine, busy_timeout_s)
        return engine
    # pre-ping: a pooled connection that died with a server restart is replaced at checkout,
    # so the first request after the database comes back does not fail on it
    return create_async_engine(
        target.url, connect_args={"server_settings": _PG_SESSION}, pool_pre_ping=True
    )


class SQLiteSQL:
    """One host, one writer at a time (BEGIN IMMEDIATE, see connection.py)."""

    dialect = Dialect.SQLITE
    insert = staticmethod(sqlite_insert)  # for on_conflict_do_update
    # insertion order, the tie-break after created_at
    batch_seq = literal_column("batches.rowid")
    file_seq = literal_column("files.rowid")
    clock_query = None  # leases use this host's clock: every process runs on it

    def __init__(self, path: Path) -> None:
        self.path = path  # the database file; per-batch lock files go beside it

    def listener(self, engine: AsyncEngine) -> Listener | None:
        return None  # idle workers poll

    def lock_claim(self, pick: Select[Any]) -> Select[Any]:
        return pick  # one writer: nobody else is claiming

    async def notify(self, conn: AsyncConnection) -> None:
        return None

    async def complete(
        self,
        conn: AsyncConnection,
        worker_id: str,
        results: Sequence[tuple[int, RequestResult]],
        now: float,
    ) -> int:
        """Store.complete: one fenced UPDATE, executemany over the results."""
        stmt = (
            update(R)
            .where(
                R.c.id == bindparam("p_id"),
                R.c.status == RUNNING,
                R.c.worker_id == bindparam("p_worker"),
            )
            .values({k: bindparam(f"p_{k}") for k in result_values(results[0][1], now)})
        )
        params = [
            {"p_id": rid, "p_worker": worker_id}
            | {f"p_{k}": v for k, v in result_values(res, now).items()}
            for rid, res in results
        ]
        return (await conn.execute(stmt, params)).rowcount

    @contextlib.asynccontextmanager
    async def batch_lock(
        self, engine: AsyncEngine, batch_id: str, finished: Finished
    ) -> AsyncIterator[bool]:
        """An `flock` on a file beside the database, which a process that dies lets go of."""
        path = lock_path(self.path.parent / "locks", batch_id)
        fd = try_lock(path)
        if fd is None:
            yield False
            return
        done = False
        try:
            yield True
            done = await finished()
        finally:
            unlock(fd, path, remove=done)  # no lock file per finished batch

    async def pragmas(self, reader: AsyncEngine) -> dict[str, Any]:
        async with reader.connect() as conn:
            return {
                name: (await conn.exec_driver_sql(f"PRAGMA {name}")).scalar()
                for name in ("journal_mode", "busy_timeout", "synchronous", "foreign_keys")
            }


def _pg_complete_sql() -> Any:
    pg = postgresql.dialect()
    arrays = ", ".join(
        f"CAST(:a_{k} AS {(R.c.id if k == 'id' else R.c[k]).type.compile(dialect=pg)}[])"
        for k in ("id", *PER_ROW)
    )
    sets = ", ".join(f"{k} = v.{k}" for k in PER_ROW)
    return text(
        f"UPDATE requests SET {sets}, finished_at = :now, lease_expires_at = NULL "
        f"FROM unnest({arrays}) AS v(id, {', '.join(PER_ROW)}) "
        f"WHERE requests.id = v.id AND requests.status = '{RUNNING}' "
        "AND requests.worker_id = :worker"
    )


class PostgresSQL:
    """Many hosts, one queue: row locks skipped not waited for, LISTEN/NOTIFY, advisory locks."""

    dialect = Dialect.POSTGRESQL
    insert = staticmethod(pg_insert)
    batch_seq = literal_column("batches.seq")
    file_seq = literal_column("files.seq")
    # the database's clock: hosts' clocks differ, leases must not
    clock_query = text("SELECT extract(epoch FROM clock_timestamp())::float8")
    _COMPLETE = _pg_complete_sql()
    _NOTIFY = text("SELECT pg_notify(:c, '')")

    def listener(self, engine: AsyncEngine) -> Listener | None:
        return Listener(engine, WORK_CHANNEL)

    def lock_claim(self, pick: Select[Any]) -> Select[Any]:
        # rows another claimer is taking are skipped, not waited for
        return pick.with_for_update(of=R, skip_locked=True)

    async def notify(self, conn: AsyncConnection) -> None:
        # sent at commit, to every listening worker on every host
        await conn.execute(self._NOTIFY, {"c": WORK_CHANNEL})

    async def complete(
        self,
        conn: AsyncConnection,
        worker_id: str,
        results: Sequence[tuple[int, RequestResult]],
        now: float,
    ) -> int:
        """Store.complete as one `UPDATE … FROM unnest(arrays)`: asyncpg's executemany reports
        no row counts, a statement per row costs a round trip each, and arrays keep the SQL text
        the same for any number of rows (one prepared statement)."""
        cols: dict[str, list[Any]] = {"id": []} | {k: [] for k in PER_ROW}
        for rid, res in results:
            cols["id"].append(rid)
            row = result_values(res, now)
            if row.keys() - PER_ROW - SAME_FOR_ALL:  # a field added to result_values only
                raise RuntimeError(f"PER_ROW lacks {sorted(row.keys() - PER_ROW)}")
            for k in PER_ROW:
                cols[k].append(row[k])
        params = {f"a_{k}": v for k, v in cols.items()} | {"now": now, "worker": worker_id}
        return (await conn.execute(self._COMPLETE, params)).rowcount

    @contextlib.asynccontextmanager
    async def batch_lock(
        self, engine: AsyncEngine, batch_id: str, finished: Finished
    ) -> AsyncIterator[bool]:
        """A session advisory lock: a host that dies lets go with its connection."""
        key = {"s": _LOCK_SPACE, "k": zlib.crc32(batch_id.encode()) - (1 << 31)}
        async with engine.connect() as conn:
            got = (await conn.execute(text("SELECT pg_try_advisory_lock(:s, :k)"), key)).scalar()
            await conn.commit()  # the lock is the session's, not the transaction's
            try:
                yield bool(got)
            finally:
                if got:
                    try:
                        await conn.execute(text("SELECT pg_advisory_unlock(:s, :k)"), key)
                        await conn.commit()
                    except Exception:
                        await conn.invalidate()  # never pool a session that may hold it

    async def pragmas(self, reader: AsyncEngine) -> dict[str, Any]:
        return {}  # SQLite's connection settings only


DialectSQL = SQLiteSQL | PostgresSQL


def sql_for(dialect: Dialect, path: Path | None) -> DialectSQL:
    if dialect is Dialect.SQLITE:
        assert path is not None
        return SQLiteSQL(path)
    return PostgresSQL()
