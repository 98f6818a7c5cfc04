"""Which database a store opens: a SQLite file path or URL, or a PostgreSQL URL."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.engine import make_url


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
    def sync_url(self) -> str:
        """The URL Alembic's sync runs take (SQLite only; PostgreSQL migrates through asyncpg)."""
        assert self.path is not None
        return f"sqlite:///{self.path}"


def parse_target(target: str | Path) -> Target:
    """`/path/to.db`, `sqlite:///…` or `postgresql[+asyncpg]://…` as a Target."""
    text = str(target)
    if "://" not in text:
        path = Path(text).expanduser().resolve()
        return Target(Dialect.SQLITE, f"sqlite+aiosqlite:///{path}", path)
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
        return Target(Dialect.POSTGRESQL, url.set(drivername="postgresql+asyncpg").render_as_string(
            hide_password=False
        ))
    raise ValueError(f"unsupported database URL {text!r}: use sqlite:///… or postgresql://…")
