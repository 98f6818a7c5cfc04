"""Which database batchmlx uses: the URL parsed once into a `Target` that everyone (settings, the
store, the migrations) asks for its dialect, instead of each deciding from the URL's spelling.

It lives beside config.py, not in store/, because the settings ask it too and store/ imports
the settings; SQLAlchemy is imported only when a URL is parsed, so importing the settings loads
no SQL (engine/host/fast_blas.py relies on that).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path

# the drivers a postgresql:// URL may name: each is carried onto asyncpg, the one batchmlx runs
PG_DRIVERS = ("asyncpg", "psycopg2", "psycopg", "pg8000")
# "scheme://user:password@": everything from the user's colon to the last "@" of the word is
# hidden, so a password holding an unescaped "@" or ":" is hidden whole
_PASSWORD = re.compile(r"(\w[\w+.-]*://[^\s:/@]*:)\S*@")


class DatabaseUrlError(ValueError):
    """A database URL (or its password file) batchmlx cannot use; the message never holds the
    password."""


def redact(text: str) -> str:
    """`text` with the password of every URL in it hidden (`user:***@`): for messages made of
    text that may quote a URL, such as a driver's error."""
    return _PASSWORD.sub(r"\1***@", text)


class Dialect(enum.Enum):
    SQLITE = "sqlite"
    POSTGRESQL = "postgresql"


@dataclass(frozen=True, slots=True)
class Target:
    """A database to open: its dialect, the async URL the store uses, and (SQLite) its file."""

    dialect: Dialect
    url: str  # sqlite+aiosqlite:///… or postgresql+asyncpg://…
    path: Path | None = None  # the SQLite file

    @property
    def is_sqlite(self) -> bool:
        return self.dialect is Dialect.SQLITE

    @property
    def is_postgresql(self) -> bool:
        return self.dialect is Dialect.POSTGRESQL

    @property
    def one_host(self) -> bool:
        """SQLite: every process of the database runs on this host (and may share its disk)."""
        return self.dialect is Dialect.SQLITE

    @property
    def files_in_database(self) -> bool:
        """Where file bytes live by default: in the database on PostgreSQL (hosts share
        nothing else), on this host's disk on SQLite."""
        return self.dialect is Dialect.POSTGRESQL

    @property
    def sync_url(self) -> str:
        """The URL Alembic's sync runs take (SQLite only; PostgreSQL migrates through asyncpg)."""
        assert self.path is not None
        return f"sqlite:///{self.path}"

    @property
    def migration_url(self) -> str:
        """The URL the migrations open: the sync one on SQLite, the asyncpg one on PostgreSQL."""
        return self.sync_url if self.is_sqlite else self.url

    @property
    def display(self) -> str:
        """The URL for messages: the password hidden."""
        from sqlalchemy.engine import make_url  # SQL only when asked (see the module docstring)

        return make_url(self.url).render_as_string(hide_password=True)


def read_password_file(path: Path) -> str:
    """The password in `path` (a secret mounted as a file): its first line, without the line
    break. Not the command line, where `ps` shows it to every user of the machine."""
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise DatabaseUrlError(f"cannot read the database password file {path}: {why}") from None
    password = text.splitlines()[0] if text else ""
    if not password:
        raise DatabaseUrlError(f"the database password file {path} is empty")
    return password


def parse_target(target: str | Path | Target, *, password: str | None = None) -> Target:
    """`/path/to.db`, `sqlite:///…` or `postgresql[+driver]://…` as a Target (a Target is
    returned as it is). `password` (PostgreSQL; from a password file) goes into the URL, which
    must then have none of its own. Errors are DatabaseUrlError, without the password."""
    if isinstance(target, Target):
        return target
    text = str(target)
    if "://" not in text:
        path = Path(text).expanduser().resolve()
        return _sqlite(path, password)
    from sqlalchemy.engine import make_url  # SQL only when asked (see the module docstring)
    from sqlalchemy.exc import ArgumentError

    try:
        url = make_url(text)
        shown = url.render_as_string(hide_password=True)
        backend, driver = url.get_backend_name(), url.get_driver_name()
    except (ArgumentError, ValueError):  # a port that is no number, no scheme, …
        raise DatabaseUrlError(f"cannot parse the database URL {redact(text)!r}") from None
    if backend == "sqlite":
        if not url.database or url.database == ":memory:":
            raise DatabaseUrlError("batchmlx needs a SQLite file, not an in-memory database")
        return _sqlite(Path(url.database).expanduser().resolve(), password)
    if backend != "postgresql":
        raise DatabaseUrlError(
            f"unsupported database URL {shown!r}: use sqlite:///FILE or postgresql://…"
        )
    if driver not in PG_DRIVERS:
        raise DatabaseUrlError(
            f"unsupported PostgreSQL driver {driver!r} in {shown!r}: use postgresql://… "
            f"(or postgresql+{'/'.join(PG_DRIVERS)}://…)"
        )
    if password is not None:
        if url.password is not None:
            raise DatabaseUrlError(
                f"{shown!r} has a password and a password file is given too: keep one"
            )
        url = url.set(password=password)
    # one driver for the store and the migrations; any spelling of the URL works
    asyncpg = url.set(drivername="postgresql+asyncpg")
    return Target(Dialect.POSTGRESQL, asyncpg.render_as_string(hide_password=False))


def _sqlite(path: Path, password: str | None) -> Target:
    if password is not None:
        raise DatabaseUrlError("a database password file is for PostgreSQL; SQLite has none")
    return Target(Dialect.SQLITE, f"sqlite+aiosqlite:///{path}", path)
