"""Settings in one place: where data lives and the defaults every entry point shares."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

DEFAULT_HOME = Path("~/.batchmlx")
DEFAULT_LEASE_S = 60.0


@dataclass(frozen=True, slots=True)
class Settings:
    home: Path  # $BATCHMLX_HOME, default ~/.batchmlx
    cache_dir: Path  # converted models; $BATCHMLX_CACHE_DIR, default $BATCHMLX_HOME/cache
    lease_s: float = DEFAULT_LEASE_S  # a claimed request's lease; renewed at a third of it
    poll_s: float = 0.5  # how often an idle worker looks for work (SQLite; PostgreSQL listens)
    default_model: str = "default"
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
    def files_dir(self) -> Path:
        return self.home / "files"

    @property
    def files_in_database(self) -> bool:
        """Where file bytes live: in the database (PostgreSQL's default: hosts share nothing
        else) or under files_dir (SQLite's)."""
        if self.file_storage:
            return self.file_storage == "database"
        url = self.database_url
        return "://" in url and not url.startswith("sqlite")

    @property
    def hostname(self) -> str:
        return self.host or socket.gethostname()


def load_settings(env: dict[str, str] | None = None) -> Settings:
    env = os.environ if env is None else env
    home = Path(env.get("BATCHMLX_HOME") or DEFAULT_HOME).expanduser()
    cache = Path(env.get("BATCHMLX_CACHE_DIR") or home / "cache").expanduser()
    lease = float(env.get("BATCHMLX_LEASE_S") or DEFAULT_LEASE_S)
    return Settings(
        home=home,
        cache_dir=cache,
        lease_s=lease,
        database=env.get("BATCHMLX_DATABASE_URL") or None,
        host=env.get("BATCHMLX_WORKER_HOST") or None,
        file_storage=env.get("BATCHMLX_FILE_STORAGE") or None,
    )
