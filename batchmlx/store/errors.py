"""Which database errors are worth retrying: the SQL driver's exceptions stay in the store."""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from batchmlx.store.types import StoreUnavailable

# SQLite's words for a lock held past busy_timeout (another process writing, a backup, …)
# and for a full disk (SQLITE_FULL): the same statement can succeed later
_TRANSIENT_WORDS = (
    "database is locked",
    "database is busy",
    "database table is locked",
    "database or disk is full",
)
# PostgreSQL's SQLSTATEs of a server that is away for now: class 08 (connection exception),
# shutting down or starting up (57P01-57P03), out of connection slots (53300)
_PG_AWAY = ("08", "57P01", "57P02", "57P03", "53300")


def _causes(exc: BaseException, depth: int = 4) -> list[BaseException]:
    """`exc`, the driver error SQLAlchemy wraps, and what they were raised from (not what
    they were raised while handling: a bug in an except block is no database fault)."""
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo and len(seen) < depth * 3:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [getattr(e, "orig", None), e.__cause__]
    return seen


def _raised_by_driver(e: BaseException) -> bool:
    """Whether `e` came out of SQLAlchemy or asyncpg (not out of, say, a client's socket)."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__", "").startswith(("sqlalchemy", "asyncpg")):
            return True
        tb = tb.tb_next
    return False


def _away(e: BaseException) -> bool:
    if isinstance(e, StoreUnavailable | PoolTimeout):
        return True  # cannot be opened; no connection left in the pool within its timeout
    if isinstance(e, ConnectionError | TimeoutError):
        return _raised_by_driver(e)  # asyncpg's connect refused, reset or timed out: raw
    if isinstance(e, DBAPIError) and e.connection_invalidated:
        return True  # SQLAlchemy saw the connection die (and dropped it from the pool)
    state = getattr(e, "sqlstate", None) or getattr(e, "pgcode", None)
    if isinstance(state, str) and (state.startswith("08") or state in _PG_AWAY):
        return True
    # asyncpg's own words for a socket that closed under a query
    return type(e).__module__.startswith("asyncpg") and "connection is closed" in str(e)


def is_transient_db_error(exc: BaseException) -> bool:
    """True when the database is busy or away for now (SQLite locked or full; PostgreSQL down,
    restarting, unreachable, out of connections; the pool exhausted): the same statement can
    succeed when retried later. Errors of the statement itself (a constraint, bad SQL) are not."""
    for e in _causes(exc):
        if isinstance(e, OperationalError) and any(w in str(e) for w in _TRANSIENT_WORDS):
            return True
        if _away(e):
            return True
    return False


def unwrapped_driver_errors() -> tuple[type[Exception], ...]:
    """The classes a driver raises past SQLAlchemy (asyncpg's, when a connect is refused by a
    server that is starting or shutting down), for handlers that must catch them by class."""
    try:
        import asyncpg
    except ImportError:
        return ()
    return (asyncpg.PostgresError, asyncpg.InterfaceError)
