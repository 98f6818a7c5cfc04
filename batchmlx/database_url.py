"""Which database batchmlx uses: the URL parsed once into a `Target` that everyone (settings, the
store, the migrations) asks for its dialect, instead of each deciding from the URL's spelling.

It lives beside config.py, not in store/, because the settings ask it too and store/ imports
the settings; SQLAlchemy is imported only when a URL is parsed, so importing the settings loads
no SQL (accel.py relies on that).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path


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


def parse_target(target: str | Path) -> Target:
    """`/path/to.db`, `sqlite:///…` or `postgresql[+driver]://…` as a Target."""
    text = str(target)
    if "://" not in text:
        path = Path(text).expanduser().resolve()
        return Target(Dialect.SQLITE, f"sqlite+aiosqlite:///{path}", path)
    from sqlalchemy.engine import make_url  # SQL only when asked (see the module docstring)

    url = make_url(text)
    backend = url.get_backend_name()
    if backend == "sqlite":
        if not url.database or url.database == ":memory:":
            raise ValueError("batchmlx needs a SQLite file, not an in-memory database")
        path = Path(url.database).expanduser().resolve()
        return Target(Dialect.SQLITE, f"sqlite+aiosqlite:///{path}", path)
    if backend == "postgresql":
        if url.get_driver_name() not in ("asyncpg", "psycopg2", "psycopg", "pg8000"):
            raise ValueError(f"unsupported PostgreSQL driver in {text!r}")
        # one driver for the store and the migrations; any spelling of the URL works
        asyncpg = url.set(drivername="postgresql+asyncpg")
        return Target(Dialect.POSTGRESQL, asyncpg.render_as_string(hide_password=False))
    raise ValueError(f"unsupported database URL {text!r}: use sqlite:///… or postgresql://…")
