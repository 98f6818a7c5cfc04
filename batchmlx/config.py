"""Settings in one place: where data lives and the defaults every entry point shares."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from batchmlx.database_url import Target, parse_target

DEFAULT_HOME = Path("~/.batchmlx")
DEFAULT_LEASE_S = 60.0
DATABASE_URL_ENV = "BATCHMLX_DATABASE_URL"  # the queue, for users; the CLI's --database-url wins


@dataclass(frozen=True, slots=True)
class Settings:
    home: Path  # $BATCHMLX_HOME, default ~/.batchmlx
    cache_dir: Path  # converted models; $BATCHMLX_CACHE_DIR, default $BATCHMLX_HOME/cache
    lease_s: float = DEFAULT_LEASE_S  # a claimed request's lease; renewed at a third of it
    poll_s: float = 0.5  # how often an idle worker looks for work (SQLite; PostgreSQL listens)
    default_model: str = "default"
    busy_timeout_s: float | None = None  # $BATCHMLX_BUSY_TIMEOUT_S; None: the store's default
    # $BATCHMLX_DATABASE_URL: sqlite:///… or postgresql+asyncpg://…; None: $BATCHMLX_HOME's file
    database: str | None = None
    # $BATCHMLX_WORKER_HOST: the host name workers register under (tests run several "hosts")
    host: str | None = None
    # $BATCHMLX_FILE_STORAGE: "local" or "database"; None: local on SQLite, database otherwise
    file_storage: str | None = None

    @property
    def db_path(self) -> Path:
        return self.home / "batchmlx.db"

    @property
    def database_url(self) -> str:
        return self.database or f"sqlite:///{self.db_path}"

    @property
    def target(self) -> Target:
        """The database URL parsed: ask it for the dialect."""
        return parse_target(self.database_url)

    @property
    def files_dir(self) -> Path:
        return self.home / "files"

    @property
    def files_in_database(self) -> bool:
        """Where file bytes live: in the database (PostgreSQL's default: hosts share nothing
        else) or under files_dir (SQLite's)."""
        if self.file_storage:
            return self.file_storage == "database"
        return self.target.files_in_database

    @property
    def hostname(self) -> str:
        return self.host or socket.gethostname()


def load_settings(
    env: Mapping[str, str] | None = None, *, database_url: str | None = None
) -> Settings:
    """Settings from the environment (default: this process's); `database_url`, parsed from
    the command line, is passed down in them rather than through the environment."""
    env = os.environ if env is None else env
    home = Path(env.get("BATCHMLX_HOME") or DEFAULT_HOME).expanduser()
    cache = Path(env.get("BATCHMLX_CACHE_DIR") or home / "cache").expanduser()
    busy = env.get("BATCHMLX_BUSY_TIMEOUT_S")
    lease = float(env.get("BATCHMLX_LEASE_S") or DEFAULT_LEASE_S)
    return Settings(
        home=home,
        cache_dir=cache,
        lease_s=lease,
        database=database_url or env.get(DATABASE_URL_ENV) or None,
        host=env.get("BATCHMLX_WORKER_HOST") or None,
        file_storage=env.get("BATCHMLX_FILE_STORAGE") or None,
        busy_timeout_s=float(busy) if busy else None,
    )


# The database and files/ hold every prompt and answer: the data directory is the user's alone.
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def private_dir(path: Path) -> Path:
    """Create `path` and its missing parents for the owner alone. A mode given to mkdir only
    loses bits to the umask, and `parents=True` ignores it, so each level is made and set."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=PRIVATE_DIR_MODE)
        except FileExistsError:
            continue  # another process made it first, with the same mode
        folder.chmod(PRIVATE_DIR_MODE)
    return path


def private_file(path: Path) -> Path:
    """Create `path` empty for the owner alone unless it exists (SQLite gives its -wal and -shm
    files the database file's mode, so creating the database this way covers them)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE)
    except FileExistsError:
        return path
    os.close(fd)
    return path
