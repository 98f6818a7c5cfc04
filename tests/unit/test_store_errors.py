"""Which database errors mean "away for now, retry" (503, backoff, the inbox file kept), and
the server's background loop that outlives them. Real exception classes of both drivers."""

from __future__ import annotations

import asyncio
import logging
import sqlite3

import pytest
from sqlalchemy.exc import IntegrityError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from batchmlx.server.context import keep_running
from batchmlx.store import StoreUnavailable
from batchmlx.store.errors import is_transient_db_error
from batchmlx.worker.resilience import Backoff


def _wrapped_in_handling(inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException:
            raise ValueError("a bug in an except block")  # noqa: B904 - the context is the point
    except ValueError as exc:
        return exc


def _refused_connect() -> BaseException:
    import asyncpg

    async def connect() -> None:
        await asyncpg.connect(host="127.0.0.1", port=1, user="x", timeout=5)

    try:
        asyncio.run(connect())
    except OSError as exc:
        return exc
    raise AssertionError("port 1 accepted a connection")


def _transient_cases() -> list[tuple[BaseException, bool]]:
    asyncpg = pytest.importorskip("asyncpg")
    closed = InterfaceError("SELECT 1", {}, Exception("connection is closed"),
                            connection_invalidated=True)  # fmt: skip
    return [
        (OperationalError("UPDATE", {}, sqlite3.OperationalError("database is locked")), True),
        (closed, True),  # SQLAlchemy saw the connection die under a query
        (_refused_connect(), True),  # asyncpg's connect raises the OSError itself
        (ConnectionRefusedError(111, "not from a driver"), False),  # e.g. a client's socket
        (asyncpg.CannotConnectNowError("the database system is starting up"), True),
        (asyncpg.AdminShutdownError("terminating connection"), True),
        (asyncpg.TooManyConnectionsError("too many clients"), True),
        (PoolTimeout("QueuePool limit of size 5 overflow 10 reached"), True),
        (StoreUnavailable("cannot open the database"), True),
        (IntegrityError("INSERT", {}, sqlite3.IntegrityError("UNIQUE constraint")), False),
        (asyncpg.UniqueViolationError("duplicate key"), False),
        (_wrapped_in_handling(ConnectionResetError()), False),
        (ValueError("x"), False),
    ]


def test_which_database_errors_are_transient() -> None:
    for exc, transient in _transient_cases():
        assert is_transient_db_error(exc) is transient, exc


def test_keep_running_logs_each_fault_and_goes_on(caplog) -> None:
    locked = OperationalError("UPDATE", {}, sqlite3.OperationalError("database is locked"))
    faults = [locked, RuntimeError("a bug")]
    runs: list[int] = []

    async def step() -> float:
        runs.append(1)
        if faults:
            raise faults.pop(0)
        if len(runs) == 4:
            raise asyncio.CancelledError  # the server stopping ends it, nothing else does
        return 0.0

    caplog.set_level(logging.WARNING, "batchmlx.server")
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(keep_running("a task", step, Backoff(first=0.01, cap=0.02)))
    assert len(runs) == 4
    texts = [r.getMessage() for r in caplog.records]
    assert texts[0].startswith("a task: the database is unavailable") and "retrying in" in texts[0]
    assert texts[1].startswith("a task failed; retrying in") and caplog.records[1].exc_info
