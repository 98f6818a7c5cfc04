"""The store: every SQL operation batchmlx performs, as named methods of one class.

One class for SQLite (the embedded default) and PostgreSQL (several hosts, one queue). On SQLite,
writes run in `BEGIN IMMEDIATE` transactions (see connection.py), so concurrent worker processes
queue up on the write lock instead of failing; reads run in deferred transactions and, under WAL,
never wait for a writer. On PostgreSQL, claims lock rows with `FOR UPDATE SKIP LOCKED`, so
workers never wait on each other, and idle workers wait on `LISTEN/NOTIFY`. Time, ids and lease
lengths come in as arguments; `clock()` is the database's clock on PostgreSQL.

The queue protocol: `claim` leases requests to a worker (`lease_expires_at`); the worker renews its
leases with `heartbeat`; `complete` is fenced (a row is written only while it is still running and
held by the caller), so a worker whose lease expired and was re-claimed cannot overwrite anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import socket
import time
import zlib
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
from sqlalchemy import (
    and_,
    bindparam,
    case,
    delete,
    func,
    insert,
    literal_column,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from batchmlx.config import Settings, private_dir, private_file
from batchmlx.core.lifecycle import BatchStatus, RequestStatus, check_transition
from batchmlx.core.records import (
    BatchErrorRecord,
    BatchRecord,
    BatchUsage,
    ClaimedRequest,
    FileRecord,
    RequestCounts,
    RequestResult,
)
from batchmlx.store.blobs import Blobs, Chunks, DatabaseBlobs, LocalBlobs
from batchmlx.store.connection import BEGIN_OPTION, DEFAULT_BUSY_TIMEOUT_S, install_sqlite_setup
from batchmlx.store.listen import Listener
from batchmlx.store.locks import lock_path, try_lock, unlock
from batchmlx.store.migrate import upgrade_to_head
from batchmlx.store.models import BATCHES, FILES, REQUESTS, WORKERS
from batchmlx.store.types import BatchRef, FileStorage, NewRequest, ResultRow, StoreUnavailable
from batchmlx.store.url import Dialect, parse_target

B, R, F, W = BATCHES, REQUESTS, FILES, WORKERS
WORK_CHANNEL = "batchmlx_work"  # NOTIFY'd when there may be new work to claim
_LOCK_SPACE = 0x626D6C79  # advisory lock key space of per-batch locks (finalize)
# server settings of every PostgreSQL session: a host that vanishes without closing its socket
# loses its connection (and the advisory locks it held) within about a minute
_PG_SESSION = {"tcp_keepalives_idle": "30", "tcp_keepalives_interval": "10",
               "tcp_keepalives_count": "3"}  # fmt: skip

_QUEUED = RequestStatus.QUEUED.value
_RUNNING = RequestStatus.RUNNING.value
_SUCCEEDED = RequestStatus.SUCCEEDED.value
_FAILED = RequestStatus.FAILED.value
_DONE = (_SUCCEEDED, _FAILED)
_NOT_DONE = (_QUEUED, _RUNNING)

# The timestamp column each status sets when a batch enters it.
_STATUS_AT: dict[BatchStatus, str] = {
    BatchStatus.IN_PROGRESS: "in_progress_at",
    BatchStatus.FINALIZING: "finalizing_at",
    BatchStatus.COMPLETED: "completed_at",
    BatchStatus.FAILED: "failed_at",
    BatchStatus.EXPIRED: "expired_at",
    BatchStatus.CANCELLING: "cancelling_at",
    BatchStatus.CANCELLED: "cancelled_at",
}
# Fields set_batch_status may change besides status and its *_at.
_SETTABLE = frozenset(
    {"endpoint", "model", "expires_at", "output_file_id", "error_file_id", "errors"}
)


def _dumps(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


def _loads(text: str | None) -> Any:
    return None if text is None else orjson.loads(text)


def _body_text(body: dict[str, Any] | str) -> str:
    return body if isinstance(body, str) else orjson.dumps(body).decode()


def _errors_json(errors: Iterable[BatchErrorRecord]) -> str:
    return _dumps(
        [{"code": e.code, "message": e.message, "line": e.line, "param": e.param} for e in errors]
    )


def _result_values(result: RequestResult, now: float) -> dict[str, Any]:
    return {
        "status": result.status.value,
        "status_code": result.status_code,
        "response_body": _dumps(result.body),
        "error": _dumps(result.error),
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "completion_tokens": result.completion_tokens,
        "cache_outcome": result.cache_outcome,
        "finished_at": now,
        "lease_expires_at": None,
    }


# PostgreSQL's complete (see Store._complete_pg): the per-row fields of _result_values as
# arrays; finished_at and lease_expires_at are the same for every row
_PER_ROW = ("status", "status_code", "response_body", "error", "prompt_tokens", "cached_tokens",
            "completion_tokens", "cache_outcome")  # fmt: skip
_SAME_FOR_ALL = frozenset({"finished_at", "lease_expires_at"})


def _pg_complete_sql() -> Any:
    from sqlalchemy.dialects import postgresql

    pg = postgresql.dialect()
    arrays = ", ".join(
        f"CAST(:a_{k} AS {(R.c.id if k == 'id' else R.c[k]).type.compile(dialect=pg)}[])"
        for k in ("id", *_PER_ROW)
    )
    sets = ", ".join(f"{k} = v.{k}" for k in _PER_ROW)
    return text(
        f"UPDATE requests SET {sets}, finished_at = :now, lease_expires_at = NULL "
        f"FROM unnest({arrays}) AS v(id, {', '.join(_PER_ROW)}) "
        f"WHERE requests.id = v.id AND requests.status = '{_RUNNING}' "
        "AND requests.worker_id = :worker"
    )


_PG_COMPLETE = _pg_complete_sql()


def _done_sum(col: Any) -> Any:
    return func.coalesce(func.sum(case((R.c.status.in_(_DONE), col), else_=0)), 0)


# Per batch: total, succeeded, failed, then token sums over done requests.
_PROGRESS_COLUMNS = (
    func.count(R.c.id),
    func.coalesce(func.sum(case((R.c.status == _SUCCEEDED, 1), else_=0)), 0),
    func.coalesce(func.sum(case((R.c.status == _FAILED, 1), else_=0)), 0),
    _done_sum(R.c.prompt_tokens),
    _done_sum(R.c.cached_tokens),
    _done_sum(R.c.completion_tokens),
)


def _progress(row: Sequence[Any] | None) -> tuple[RequestCounts, BatchUsage]:
    if row is None:
        return RequestCounts(), BatchUsage()
    total, ok, failed, prompt, cached, completion = row
    return (
        RequestCounts(total=total, completed=ok, failed=failed),
        BatchUsage(input_tokens=prompt, cached_tokens=cached, output_tokens=completion),
    )


def _batch_record(m: Mapping[str, Any], progress: Sequence[Any] | None) -> BatchRecord:
    counts, usage = _progress(progress)
    return BatchRecord(
        id=m["id"],
        endpoint=m["endpoint"],
        model=m["model"],
        input_file_id=m["input_file_id"],
        completion_window=m["completion_window"],
        status=BatchStatus(m["status"]),
        created_at=m["created_at"],
        expires_at=m["expires_at"],
        in_progress_at=m["in_progress_at"],
        finalizing_at=m["finalizing_at"],
        completed_at=m["completed_at"],
        failed_at=m["failed_at"],
        expired_at=m["expired_at"],
        cancelling_at=m["cancelling_at"],
        cancelled_at=m["cancelled_at"],
        output_file_id=m["output_file_id"],
        error_file_id=m["error_file_id"],
        errors=tuple(BatchErrorRecord(**e) for e in _loads(m["errors"]) or ()),
        request_counts=counts,
        usage=usage,
        metadata=_loads(m["metadata"]),
        stats=_loads(m["stats"]) or {},
        output_expires_after=m.get("output_expires_after"),
    )


def _file_record(m: Mapping[str, Any]) -> FileRecord:
    return FileRecord(
        id=m["id"],
        filename=m["filename"],
        purpose=m["purpose"],
        bytes=m["bytes"],
        created_at=m["created_at"],
        path=m["path"],
        expires_at=m.get("expires_at"),
    )


class Store:
    """The seam between batchmlx and its database. Open with `await Store.open(path or URL)`."""

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
        self._engine = engine  # SQLite: transactions begin IMMEDIATE; use for anything that writes
        self._reader = engine.execution_options(**{BEGIN_OPTION: "DEFERRED"})
        pg = dialect is Dialect.POSTGRESQL
        # insertion order, the tie-break after created_at: SQLite's rowid, PostgreSQL's `seq`
        self._b_seq = literal_column("batches.seq" if pg else "batches.rowid")
        self._f_seq = literal_column("files.seq" if pg else "files.rowid")
        self._insert = pg_insert if pg else sqlite_insert
        self._listener = Listener(engine, WORK_CHANNEL) if pg else None
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

    @classmethod
    async def open(
        cls,
        target: str | Path,
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
        if t.dialect is Dialect.POSTGRESQL and importlib.util.find_spec("asyncpg") is None:
            raise RuntimeError("PostgreSQL needs asyncpg: pip install 'batchmlx[postgres]'")
        if t.dialect is Dialect.SQLITE:
            assert t.path is not None
            # the database holds every prompt and answer: the user's alone (0700 / 0600)
            private_file(private_dir(t.path.parent) / t.path.name)
            files_dir = files_dir or t.path.parent / "files"
        default = FileStorage.LOCAL if t.dialect is Dialect.SQLITE else FileStorage.DATABASE
        try:
            await asyncio.to_thread(upgrade_to_head, t)
        except (OSError, DBAPIError) as exc:
            where = make_url(t.url).render_as_string(hide_password=True)
            raise StoreUnavailable(f"cannot open the database {where}: {exc}") from exc
        if t.dialect is Dialect.SQLITE:
            engine = create_async_engine(t.url)
            install_sqlite_setup(engine.sync_engine, busy_timeout_s)
        else:
            engine = create_async_engine(t.url, connect_args={"server_settings": _PG_SESSION})
        store = cls(engine, t.dialect, path=t.path, files=files or default, files_dir=files_dir)
        await store.sync_clock()
        return store

    @classmethod
    async def from_settings(cls, settings: Settings) -> Store:
        """The store `settings` (batchmlx.config.Settings) name: database URL and file place."""
        files = FileStorage.DATABASE if settings.files_in_database else FileStorage.LOCAL
        timeout = settings.busy_timeout_s
        busy = {} if timeout is None else {"busy_timeout_s": timeout}
        return await cls.open(
            settings.database_url, files_dir=settings.files_dir, files=files, **busy
        )

    async def close(self) -> None:
        if self._listener is not None:
            await self._listener.close()
        await self._engine.dispose()

    async def pragmas(self) -> dict[str, Any]:
        """The connection settings in force (SQLite; for diagnostics and tests)."""
        if self.dialect is not Dialect.SQLITE:
            return {}
        async with self._reader.connect() as conn:
            return {
                name: (await conn.exec_driver_sql(f"PRAGMA {name}")).scalar()
                for name in ("journal_mode", "busy_timeout", "synchronous", "foreign_keys")
            }

    # -- time and wake-ups --------------------------------------------------------------------

    def clock(self) -> float:
        """Now, in unix seconds, as leases must be stamped: the database's clock on PostgreSQL
        (hosts' clocks differ), this host's on SQLite (one host)."""
        if self._db_epoch is None:
            return time.time()
        return self._db_epoch + (time.monotonic() - self._mono)

    async def sync_clock(self, conn: AsyncConnection | None = None) -> None:
        """Read the database's clock (PostgreSQL; a no-op on SQLite)."""
        if self.dialect is not Dialect.POSTGRESQL:
            return
        query = text("SELECT extract(epoch FROM clock_timestamp())::float8")
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

    @property
    def listens(self) -> bool:
        """True when `wait_for_work` wakes on notifications rather than only sleeping."""
        return self._listener is not None

    async def wait_for_work(self, timeout: float) -> bool:
        """Sleep up to `timeout`; on PostgreSQL wake at once when work may have arrived
        (a batch started, requests released, a batch cancelled). True when woken early."""
        if self._listener is None:
            await asyncio.sleep(timeout)
            return False
        return await self._listener.wait(timeout)

    async def _notify(self, conn: AsyncConnection) -> None:
        # sent at commit, to every listening worker on every host
        if self.dialect is Dialect.POSTGRESQL:
            await conn.execute(text("SELECT pg_notify(:c, '')"), {"c": WORK_CHANNEL})

    async def next_lease_end(self) -> float | None:
        """When the first running lease of an in-progress batch ends (None: none runs): an idle
        worker wakes then to take over a dead worker's requests."""
        query = (
            select(func.min(R.c.lease_expires_at))
            .join(B, B.c.id == R.c.batch_id)
            .where(R.c.status == _RUNNING, B.c.status == BatchStatus.IN_PROGRESS.value)
        )
        async with self._reader.connect() as conn:
            return (await conn.execute(query)).scalar()

    @contextlib.asynccontextmanager
    async def batch_lock(self, batch_id: str) -> AsyncIterator[bool]:
        """Try to become the one process working on `batch_id` (finalize): yields True when
        this process holds it. On PostgreSQL a session advisory lock, so a host that dies
        lets go with its connection; on SQLite (one host) an `flock` on a file beside the
        database, which a process that dies lets go of too."""
        if self.dialect is not Dialect.POSTGRESQL:
            assert self.path is not None
            path = lock_path(self.path.parent / "locks", batch_id)
            fd = try_lock(path)
            if fd is None:
                yield False
                return
            finished = False
            try:
                yield True
                status = await self._batch_status(batch_id)
                finished = status is None or BatchStatus(status).terminal
            finally:
                unlock(fd, path, remove=finished)  # no lock file per finished batch
            return
        key = {"s": _LOCK_SPACE, "k": zlib.crc32(batch_id.encode()) - (1 << 31)}
        async with self._engine.connect() as conn:
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

    # -- files -------------------------------------------------------------------------------

    async def add_file(self, rec: FileRecord, *, replace: bool = False) -> None:
        """Record a stored file; with `replace`, a record with the same id is overwritten
        (finalize redone after a crash derives the same file ids)."""
        values = {
            "id": rec.id,
            "filename": rec.filename,
            "purpose": rec.purpose,
            "bytes": rec.bytes,
            "created_at": rec.created_at,
            "path": rec.path,
            "expires_at": rec.expires_at,
        }
        stmt = self._insert(F).values(**values)
        if replace:
            stmt = stmt.on_conflict_do_update(
                index_elements=[F.c.id], set_={k: v for k, v in values.items() if k != "id"}
            )
        async with self._engine.begin() as conn:
            await conn.execute(stmt)

    async def save_file(
        self,
        file_id: str,
        chunks: Chunks,
        *,
        filename: str,
        purpose: str,
        created_at: int,
        replace: bool = False,
        expires_at: int | None = None,
    ) -> FileRecord:
        """Store a file's bytes (streamed, atomically) and record it; see `add_file`. A file
        with `expires_at` is deleted by the worker's housekeeping once that time has passed."""
        size, location = await self.blobs.put(file_id, chunks)
        rec = FileRecord(file_id, filename, purpose, size, created_at, location, expires_at)
        try:
            await self.add_file(rec, replace=replace)
        except BaseException:
            if not replace:  # no stored bytes without their record
                await self.blobs.delete(file_id, location)
            raise
        return rec

    def read_file(self, rec: FileRecord) -> AsyncIterator[bytes]:
        """A stored file's bytes, in chunks."""
        return self.blobs.read(rec.id, rec.path)

    async def read_file_bytes(self, rec: FileRecord) -> bytes:
        """A stored file's bytes at once (for files known to be small, or validation)."""
        return b"".join([c async for c in self.read_file(rec)])

    async def delete_file_bytes(self, rec: FileRecord) -> None:
        await self.blobs.delete(rec.id, rec.path)

    async def get_file(self, file_id: str) -> FileRecord | None:
        async with self._reader.connect() as conn:
            row = (await conn.execute(select(F).where(F.c.id == file_id))).mappings().first()
        return None if row is None else _file_record(row)

    # -- batches -----------------------------------------------------------------------------

    async def create_batch(
        self,
        rec: BatchRecord,
        *,
        content_hash: str | None = None,
        source: str | None = None,
    ) -> None:
        """Store a batch without requests: `start_validated_batch` is what enqueues them."""
        batch_values = {
            "id": rec.id,
            "endpoint": rec.endpoint,
            "model": rec.model,
            "input_file_id": rec.input_file_id,
            "completion_window": rec.completion_window,
            "status": rec.status.value,
            "created_at": rec.created_at,
            "expires_at": rec.expires_at,
            "in_progress_at": rec.in_progress_at,
            "failed_at": rec.failed_at,
            "output_file_id": rec.output_file_id,
            "error_file_id": rec.error_file_id,
            "errors": _errors_json(rec.errors) if rec.errors else None,
            "metadata": _dumps(rec.metadata),
            "content_hash": content_hash,
            "source": source,
            "stats": _dumps(rec.stats or {}),
            "output_expires_after": rec.output_expires_after,
        }
        async with self._engine.begin() as conn:
            await conn.execute(insert(B).values(**batch_values))

    async def get_batch(self, batch_id: str) -> BatchRecord | None:
        """The batch with live request counts and token usage summed from its requests."""
        async with self._reader.connect() as conn:
            return await self._read_batch(conn, batch_id)

    async def list_batches(self, limit: int = 20, after: str | None = None) -> list[BatchRecord]:
        """Newest first; `after` is the id of the last batch of the previous page."""
        query = select(B).order_by(B.c.created_at.desc(), self._b_seq.desc()).limit(limit)
        async with self._reader.connect() as conn:
            if after is not None:
                cursor = (
                    await conn.execute(select(B.c.created_at, self._b_seq).where(B.c.id == after))
                ).first()
                if cursor is None:
                    return []
                created, seq = cursor
                query = query.where(
                    or_(
                        B.c.created_at < created,
                        and_(B.c.created_at == created, self._b_seq < seq),
                    )
                )
            rows = (await conn.execute(query)).mappings().all()
            ids = [r["id"] for r in rows]
            progress = {
                p[0]: p[1:]
                for p in await conn.execute(
                    select(R.c.batch_id, *_PROGRESS_COLUMNS)
                    .where(R.c.batch_id.in_(ids))
                    .group_by(R.c.batch_id)
                )
            }
        return [_batch_record(r, progress.get(r["id"])) for r in rows]

    async def batch_source(self, batch_id: str) -> str | None:
        """Where the batch came from: "cli", "inbox:/dir/name.jsonl", … (None if unknown)."""
        async with self._reader.connect() as conn:
            return (await conn.execute(select(B.c.source).where(B.c.id == batch_id))).scalar()

    async def find_batch_by_hash(
        self, content_hash: str, statuses: Iterable[BatchStatus] | None = None
    ) -> BatchRecord | None:
        """The newest batch made from a file with this content hash (in one of `statuses`)."""
        where = [B.c.content_hash == content_hash]
        if statuses is not None:
            where.append(B.c.status.in_([s.value for s in statuses]))
        return await self._newest_batch(*where)

    async def find_batch_by_source(self, source: str) -> BatchRecord | None:
        """The newest batch whose `source` is exactly this (an inbox drop, say)."""
        return await self._newest_batch(B.c.source == source)

    async def _newest_batch(self, *where: Any) -> BatchRecord | None:
        async with self._reader.connect() as conn:
            batch_id = (
                await conn.execute(
                    select(B.c.id)
                    .where(*where)
                    .order_by(B.c.created_at.desc(), self._b_seq.desc())
                    .limit(1)
                )
            ).scalar()
            return None if batch_id is None else await self._read_batch(conn, batch_id)

    async def set_batch_status(
        self, batch_id: str, status: BatchStatus, now: float, **fields: Any
    ) -> BatchRecord:
        """Move a batch to `status` (checked against the lifecycle table) and stamp its *_at.

        `fields` may set model, expires_at, output_file_id, error_file_id and errors (a sequence
        of BatchErrorRecord). Raises KeyError for an unknown batch, TransitionError for a move
        the lifecycle forbids.
        """
        unknown = set(fields) - _SETTABLE
        if unknown:
            raise TypeError(f"set_batch_status cannot set {sorted(unknown)}")
        values: dict[str, Any] = dict(fields, status=status.value)
        if "errors" in values:
            values["errors"] = _errors_json(values["errors"])
        if status in _STATUS_AT:
            values[_STATUS_AT[status]] = int(now)
        async with self._engine.begin() as conn:
            # FOR UPDATE: two hosts moving one batch at once take turns (SQLite: BEGIN IMMEDIATE)
            current = (
                await conn.execute(
                    select(B.c.status).where(B.c.id == batch_id).with_for_update()
                )
            ).scalar()
            if current is None:
                raise KeyError(batch_id)
            check_transition(BatchStatus(current), status)
            await conn.execute(update(B).where(B.c.id == batch_id).values(**values))
            if status in (BatchStatus.IN_PROGRESS, BatchStatus.CANCELLING):
                await self._notify(conn)
            record = await self._read_batch(conn, batch_id)
        assert record is not None
        return record

    async def update_batch_stats(self, batch_id: str, stats: dict[str, Any]) -> None:
        """Merge `stats` into the batch's stats object (top-level keys replace)."""
        async with self._engine.begin() as conn:
            current = (await conn.execute(select(B.c.stats).where(B.c.id == batch_id))).first()
            if current is None:
                raise KeyError(batch_id)
            merged = {**(_loads(current[0]) or {}), **stats}
            await conn.execute(update(B).where(B.c.id == batch_id).values(stats=_dumps(merged)))

    async def batches_with_status(self, *statuses: BatchStatus) -> list[BatchRef]:
        """Batches in any of `statuses`, oldest first (claim order); no request counts."""
        query = (
            select(B.c.id, B.c.status, B.c.endpoint, B.c.model, B.c.created_at, B.c.expires_at)
            .where(B.c.status.in_([s.value for s in statuses]))
            .order_by(B.c.created_at, self._b_seq)
        )
        async with self._reader.connect() as conn:
            rows = (await conn.execute(query)).all()
        return [
            BatchRef(r.id, BatchStatus(r.status), r.endpoint, r.model, r.created_at, r.expires_at)
            for r in rows
        ]

    async def active_batches(self) -> list[BatchRef]:
        """In-progress batches, oldest first: those `claim` takes requests from."""
        return await self.batches_with_status(BatchStatus.IN_PROGRESS)

    async def status_counts(self) -> tuple[dict[BatchStatus, int], dict[RequestStatus, int]]:
        """Batches and requests by status, every status present (0 where none): queue depth."""
        async with self._reader.connect() as conn:
            batches = dict((await conn.execute(
                select(B.c.status, func.count()).group_by(B.c.status))).all())  # fmt: skip
            requests = dict((await conn.execute(
                select(R.c.status, func.count()).group_by(R.c.status))).all())  # fmt: skip
        return (
            {s: batches.get(s.value, 0) for s in BatchStatus},
            {s: requests.get(s.value, 0) for s in RequestStatus},
        )

    async def batches_to_finalize(self) -> list[str]:
        """Batches to finalize, oldest first: in-progress ones whose every request is done
        (succeeded or failed), and finalizing ones a crash left half-finalized."""
        pending = select(R.c.id).where(R.c.batch_id == B.c.id, R.c.status.in_(_NOT_DONE))
        ready = and_(B.c.status == BatchStatus.IN_PROGRESS.value, ~pending.exists())
        query = (
            select(B.c.id)
            .where(or_(ready, B.c.status == BatchStatus.FINALIZING.value))
            .order_by(B.c.created_at, self._b_seq)
        )
        async with self._reader.connect() as conn:
            return list((await conn.execute(query)).scalars())

    def _results_query(self, batch_id: str, output: bool | None) -> Any:
        query = select(R).where(R.c.batch_id == batch_id, R.c.status.in_(_DONE))
        # the output file's lines: what formats.output renders there (a success with a body)
        to_output = and_(R.c.status == _SUCCEEDED, R.c.response_body.is_not(None))
        if output is not None:
            query = query.where(to_output if output else ~to_output)
        return query.order_by(R.c.line)

    async def iter_results(self, batch_id: str) -> list[ResultRow]:
        """The batch's done requests in input line order (all at once: small batches)."""
        return [r async for r in self.stream_results(batch_id)]

    async def stream_results(
        self, batch_id: str, *, output: bool | None = None, per: int = 256
    ) -> AsyncIterator[ResultRow]:
        """The batch's done requests in input line order, `per` rows in memory at a time.
        `output` True: only those of the output file (succeeded, with a body); False: only
        those of the error file; None: all."""
        query = self._results_query(batch_id, output).execution_options(yield_per=per)
        # one read transaction: a snapshot of the rows, however long the caller takes
        async with self._reader.connect() as conn:
            result = await conn.stream(query)
            async for m in result.mappings():
                yield ResultRow(
                    id=m["id"],
                    custom_id=m["custom_id"],
                    line=m["line"],
                    status=RequestStatus(m["status"]),
                    status_code=m["status_code"],
                    response_body=_loads(m["response_body"]),
                    error=_loads(m["error"]),
                    prompt_tokens=m["prompt_tokens"],
                    cached_tokens=m["cached_tokens"],
                    completion_tokens=m["completion_tokens"],
                    cache_outcome=m["cache_outcome"],
                    attempts=m["attempts"],
                    finished_at=m["finished_at"],
                )

    async def has_error_code(self, batch_id: str, code: str) -> bool:
        """Whether a done request of the batch carries an error object with this `code`."""
        query = (
            select(R.c.error)
            .where(R.c.batch_id == batch_id, R.c.status.in_(_DONE), R.c.error.contains(code))
            .execution_options(yield_per=256)
        )
        async with self._reader.connect() as conn:
            result = await conn.stream(query)
            async for (error,) in result:
                if (_loads(error) or {}).get("code") == code:
                    return True
        return False

    async def finish_unfinished(self, batch_id: str, result: RequestResult, now: float) -> int:
        """Give every not-done request of the batch `result` (cancel, expiry); returns how many.

        Not fenced: a worker still holding one of these rows will find its `complete` ignored.
        """
        stmt = (
            update(R)
            .where(R.c.batch_id == batch_id, R.c.status.in_(_NOT_DONE))
            .values(**_result_values(result, now))
        )
        async with self._engine.begin() as conn:
            return (await conn.execute(stmt)).rowcount

    # -- the queue ---------------------------------------------------------------------------

    async def claim(
        self,
        worker_id: str,
        limit: int,
        now: float,
        lease_s: float,
        batch_id: str | None = None,
    ) -> list[ClaimedRequest]:
        """Lease up to `limit` requests to `worker_id`: queued ones, or running ones whose lease
        expired (a dead worker's), from in-progress batches; oldest batch first, then line order.
        """
        if limit <= 0:
            return []
        claimable = or_(
            R.c.status == _QUEUED, and_(R.c.status == _RUNNING, R.c.lease_expires_at < now)
        )
        pick = (
            select(R.c.id)
            .join(B, B.c.id == R.c.batch_id)
            .where(B.c.status == BatchStatus.IN_PROGRESS.value, claimable)
            .limit(limit)
        )
        if batch_id is not None:
            # line order alone: the (batch_id, line) index yields it, no sort of the whole batch
            pick = pick.where(R.c.batch_id == batch_id).order_by(R.c.line)
        else:
            pick = pick.order_by(B.c.created_at, self._b_seq, R.c.line)
        if self.dialect is Dialect.POSTGRESQL:
            # rows another claimer is taking are skipped, not waited for (SQLite has one writer)
            pick = pick.with_for_update(of=R, skip_locked=True)
        stmt = (
            update(R)
            .where(R.c.id.in_(pick))
            .values(
                status=_RUNNING,
                worker_id=worker_id,
                lease_expires_at=now + lease_s,
                attempts=R.c.attempts + 1,
                claimed_at=now,
            )
            .returning(R.c.id, R.c.batch_id, R.c.custom_id, R.c.line, R.c.body, R.c.attempts)
        )
        async with self._engine.begin() as conn:
            rows = (await conn.execute(stmt)).all()
            if not rows:
                return []
            batches = {
                b.id: b
                for b in await conn.execute(
                    select(
                        B.c.id, B.c.endpoint, B.c.model, B.c.created_at, self._b_seq.label("seq")
                    ).where(B.c.id.in_({r.batch_id for r in rows}))
                )
            }
        rows.sort(key=lambda r: (batches[r.batch_id].created_at, batches[r.batch_id].seq, r.line))
        return [
            ClaimedRequest(
                id=r.id,
                batch_id=r.batch_id,
                custom_id=r.custom_id,
                line=r.line,
                endpoint=batches[r.batch_id].endpoint,
                model=batches[r.batch_id].model,
                body=orjson.loads(r.body),
                attempts=r.attempts,
            )
            for r in rows
        ]

    async def heartbeat(
        self,
        worker_id: str,
        now: float,
        lease_s: float,
        pid: int | None = None,
        hostname: str | None = None,
    ) -> int:
        """Extend every lease `worker_id` holds to now + lease_s and record that it is alive.

        Returns how many leases were renewed.
        """
        renew = (
            update(R)
            .where(R.c.worker_id == worker_id, R.c.status == _RUNNING)
            .values(lease_expires_at=now + lease_s)
        )
        upsert = self._insert(W).values(
            id=worker_id,
            pid=pid,
            hostname=hostname or socket.gethostname(),
            started_at=now,
            heartbeat_at=now,
        )
        upsert = upsert.on_conflict_do_update(
            index_elements=[W.c.id],
            set_={
                "heartbeat_at": upsert.excluded.heartbeat_at,
                "pid": func.coalesce(upsert.excluded.pid, W.c.pid),
                "hostname": upsert.excluded.hostname,
            },
        )
        async with self._engine.begin() as conn:
            renewed = (await conn.execute(renew)).rowcount
            await conn.execute(upsert)
            await self.sync_clock(conn)
        return renewed

    async def complete(
        self, worker_id: str, results: Sequence[tuple[int, RequestResult]], now: float
    ) -> int:
        """Record many results in one transaction; returns how many rows were written.

        Fenced: a row is written only while it is running and held by `worker_id`, so a late
        write from a worker whose lease expired (and was re-claimed or finished) changes nothing.
        """
        if not results:
            return 0
        stmt = (
            update(R)
            .where(
                R.c.id == bindparam("p_id"),
                R.c.status == _RUNNING,
                R.c.worker_id == bindparam("p_worker"),
            )
            .values({k: bindparam(f"p_{k}") for k in _result_values(results[0][1], now)})
        )
        params = [
            {"p_id": rid, "p_worker": worker_id}
            | {f"p_{k}": v for k, v in _result_values(res, now).items()}
            for rid, res in results
        ]
        if self.dialect is Dialect.POSTGRESQL:
            return await self._complete_pg(worker_id, results, now)
        async with self._engine.begin() as conn:
            return (await conn.execute(stmt, params)).rowcount

    async def _complete_pg(
        self, worker_id: str, results: Sequence[tuple[int, RequestResult]], now: float
    ) -> int:
        """`complete` as one `UPDATE … FROM unnest(arrays)`: asyncpg's executemany reports no
        row counts, a statement per row costs a round trip each, and arrays keep the SQL text
        the same for any number of rows (one prepared statement)."""
        cols: dict[str, list[Any]] = {"id": []} | {k: [] for k in _PER_ROW}
        for rid, res in results:
            cols["id"].append(rid)
            row = _result_values(res, now)
            if row.keys() - _PER_ROW - _SAME_FOR_ALL:  # a field added to _result_values only
                raise RuntimeError(f"_PER_ROW lacks {sorted(row.keys() - _PER_ROW)}")
            for k in _PER_ROW:
                cols[k].append(row[k])
        params = {f"a_{k}": v for k, v in cols.items()} | {"now": now, "worker": worker_id}
        async with self._engine.begin() as conn:
            return (await conn.execute(_PG_COMPLETE, params)).rowcount

    async def release(self, worker_id: str, request_ids: Sequence[int] | None = None) -> int:
        """Put requests `worker_id` holds back in the queue (all of them when `request_ids` is
        None), e.g. on SIGTERM or preemption. Stopping is not failing: the claim's attempt is
        taken back, so `attempts` counts only runs that ended with the worker gone. Returns
        how many."""
        stmt = (
            update(R)
            .where(R.c.worker_id == worker_id, R.c.status == _RUNNING)
            .values(
                status=_QUEUED,
                worker_id=None,
                lease_expires_at=None,
                claimed_at=None,
                # not max(a, b): SQLite's two-argument max is no PostgreSQL function
                attempts=case((R.c.attempts > 0, R.c.attempts - 1), else_=0),
            )
        )
        if request_ids is not None:
            if not request_ids:
                return 0
            stmt = stmt.where(R.c.id.in_(list(request_ids)))
        async with self._engine.begin() as conn:
            n = (await conn.execute(stmt)).rowcount
            if n:
                await self._notify(conn)
            return n

    # -- workers -----------------------------------------------------------------------------

    async def live_workers(self, now: float, within_s: float) -> list[str]:
        """Workers that sent a heartbeat in the last `within_s` seconds."""
        query = select(W.c.id).where(W.c.heartbeat_at >= now - within_s).order_by(W.c.id)
        async with self._reader.connect() as conn:
            return list((await conn.execute(query)).scalars())

    async def workers_on_host(self, hostname: str) -> list[tuple[str, int | None]]:
        """(worker id, pid) of every registered worker of `hostname`."""
        query = select(W.c.id, W.c.pid).where(W.c.hostname == hostname).order_by(W.c.id)
        async with self._reader.connect() as conn:
            return [(r.id, r.pid) for r in await conn.execute(query)]

    async def abandon_worker(self, worker_id: str) -> int:
        """A worker known dead (its process is gone): end its leases now, so its requests are
        claimed again at once rather than when the leases run out, and forget the worker.
        `attempts` stays counted: the run died. Returns how many leases ended."""
        stmt = (
            update(R)
            .where(R.c.worker_id == worker_id, R.c.status == _RUNNING)
            .values(lease_expires_at=0.0)
        )
        async with self._engine.begin() as conn:
            n = (await conn.execute(stmt)).rowcount
            if n:
                await self._notify(conn)
            await conn.execute(delete(W).where(W.c.id == worker_id))
        return n

    async def remove_worker(self, worker_id: str) -> None:
        async with self._engine.begin() as conn:
            await conn.execute(delete(W).where(W.c.id == worker_id))

    # -- helpers -----------------------------------------------------------------------------

    async def _batch_status(self, batch_id: str) -> str | None:
        async with self._reader.connect() as conn:
            return (await conn.execute(select(B.c.status).where(B.c.id == batch_id))).scalar()

    @staticmethod
    async def _read_batch(conn: AsyncConnection, batch_id: str) -> BatchRecord | None:
        row = (await conn.execute(select(B).where(B.c.id == batch_id))).mappings().first()
        if row is None:
            return None
        progress = (
            await conn.execute(select(*_PROGRESS_COLUMNS).where(R.c.batch_id == batch_id))
        ).first()
        return _batch_record(row, progress)

    # -- the HTTP API ------------------------------------------------------------------------

    async def list_files_page(
        self,
        *,
        purpose: str | None = None,
        limit: int = 10_000,
        order: str = "desc",
        after: str | None = None,
    ) -> list[FileRecord]:
        """A page of files by creation time (`order` "asc" or "desc"); `after` is the id of the
        last file of the previous page. An unknown `after` gives an empty page."""
        seq = self._f_seq
        desc = order == "desc"
        query = select(F).order_by(
            *((F.c.created_at.desc(), seq.desc()) if desc else (F.c.created_at, seq))
        )
        if purpose is not None:
            query = query.where(F.c.purpose == purpose)
        async with self._reader.connect() as conn:
            if after is not None:
                cursor = (
                    await conn.execute(select(F.c.created_at, seq).where(F.c.id == after))
                ).first()
                if cursor is None:
                    return []
                created, rowid = cursor
                if desc:
                    beyond = or_(
                        F.c.created_at < created, and_(F.c.created_at == created, seq < rowid)
                    )
                else:
                    beyond = or_(
                        F.c.created_at > created, and_(F.c.created_at == created, seq > rowid)
                    )
                query = query.where(beyond)
            rows = (await conn.execute(query.limit(limit))).mappings().all()
        return [_file_record(r) for r in rows]

    async def expired_files(self, now: float) -> list[FileRecord]:
        """Files whose `expires_at` has passed, oldest expiry first."""
        query = select(F).where(F.c.expires_at <= int(now)).order_by(F.c.expires_at)
        async with self._reader.connect() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [_file_record(r) for r in rows]

    async def delete_file(self, file_id: str) -> FileRecord | None:
        """Forget a file's record; returns it (None when unknown). The bytes are the caller's."""
        async with self._engine.begin() as conn:
            row = (await conn.execute(select(F).where(F.c.id == file_id))).mappings().first()
            if row is None:
                return None
            await conn.execute(delete(F).where(F.c.id == file_id))
        return _file_record(row)

    async def start_validated_batch(
        self,
        batch_id: str,
        requests: Sequence[NewRequest],
        now: float,
        *,
        model: str | None,
        endpoint: str | None = None,
        content_hash: str | None = None,
    ) -> bool:
        """validating → in_progress with its requests enqueued, in one transaction. False (and
        nothing written) when the batch is no longer validating: another process got there."""
        async with self.enqueue(batch_id) as q:
            if q is None:
                return False
            await q.add(requests)
            return await q.start(now, model=model, endpoint=endpoint, content_hash=content_hash)

    @contextlib.asynccontextmanager
    async def enqueue(self, batch_id: str) -> AsyncIterator[Enqueue | None]:
        """One transaction that writes a validating batch's requests as they come (`add`, any
        number of times) and then starts it (`start`): the one place request rows are written.
        Nothing is visible before it commits, and nothing is kept unless `start` was called
        (a file that fails validation half-way, an exception, a crash). Yields None when the
        batch is no longer validating. Two callers take turns (the batch row is locked)."""
        async with self._engine.connect() as conn:
            tx = await conn.begin()
            try:
                current = (
                    await conn.execute(
                        select(B.c.status).where(B.c.id == batch_id).with_for_update()
                    )
                ).scalar()
                if current is None:
                    raise KeyError(batch_id)
                if current != BatchStatus.VALIDATING.value:
                    await tx.rollback()
                    yield None
                    return
                q = Enqueue(self, conn, batch_id)
                yield q
                if q.started:
                    await tx.commit()
                else:
                    await tx.rollback()
            except BaseException:
                if tx.is_active:
                    await tx.rollback()
                raise


class Enqueue:
    """A validating batch's requests on their way in (see `Store.enqueue`)."""

    def __init__(self, store: Store, conn: AsyncConnection, batch_id: str) -> None:
        self._store, self._conn, self.batch_id = store, conn, batch_id
        self.added = 0  # request rows written so far
        self.started = False

    async def add(self, requests: Sequence[NewRequest]) -> None:
        if not requests:
            return
        rows = [
            {
                "batch_id": self.batch_id,
                "line": r.line,
                "custom_id": r.custom_id,
                "body": _body_text(r.body),
                "status": _QUEUED,
            }
            for r in requests
        ]
        await self._conn.execute(insert(R), rows)  # executemany: one prepared statement
        self.added += len(rows)

    async def start(
        self,
        now: float,
        *,
        model: str | None,
        endpoint: str | None = None,
        content_hash: str | None = None,
    ) -> bool:
        """validating → in_progress, committed with the requests when the block ends."""
        check_transition(BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
        values: dict[str, Any] = {
            "status": BatchStatus.IN_PROGRESS.value,
            "in_progress_at": int(now),
            "model": model,
        }
        if endpoint is not None:
            values["endpoint"] = endpoint
        if content_hash is not None:
            values["content_hash"] = content_hash
        move = (
            update(B)
            .where(B.c.id == self.batch_id, B.c.status == BatchStatus.VALIDATING.value)
            .values(**values)
        )
        if (await self._conn.execute(move)).rowcount != 1:
            return False
        if self.added:
            await self._store._notify(self._conn)
        self.started = True
        return True
