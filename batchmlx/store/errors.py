"""Which database errors are worth retrying: the SQL driver's exceptions stay in the store."""

from __future__ import annotations

from sqlalchemy.exc import OperationalError

# SQLite's words for a lock held past busy_timeout (another process writing, a backup, …)
# and for a full disk (SQLITE_FULL): the same statement can succeed later
_TRANSIENT_WORDS = (
    "database is locked",
    "database is busy",
    "database table is locked",
    "database or disk is full",
)


def is_transient_db_error(exc: BaseException) -> bool:
    """True for a lock or busy error: the same statement can succeed when retried later."""
    return isinstance(exc, OperationalError) and any(w in str(exc) for w in _TRANSIENT_WORDS)
