"""Settings in one place: where data lives and the defaults every entry point shares."""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from batchmlx.core.model_rule import (
    MODEL_ALIASES_ENV,
    STRICT_MODELS_ENV,
    parse_aliases,
    split_aliases,
    truthy,
)
from batchmlx.database_url import Target, parse_target, read_password_file

DEFAULT_HOME = Path("~/.batchmlx")
DEFAULT_LEASE_S = 60.0
DATABASE_URL_ENV = "BATCHMLX_DATABASE_URL"  # the queue, for users; the CLI's --database-url wins
# a file holding the PostgreSQL password, so that no command line (`ps`) shows it; libpq's
# PGPASSWORD and PGPASSFILE (~/.pgpass) work too, for a URL without a password (asyncpg reads them)
PASSWORD_FILE_ENV = "BATCHMLX_DATABASE_PASSWORD_FILE"
# days a finished batch is kept (then purged: rows and files); unset: kept until deleted
RETENTION_DAYS_ENV = "BATCHMLX_RETENTION_DAYS"
# the CPU backend's (engine/host/; docs/engine.md)
THREADS_ENV = "BATCHMLX_THREADS"  # the --threads flag's variable (typer reads it for the flag)
HOST_STEPS_ENV = "BATCHMLX_HOST_STEPS"  # 0: packed steps of a host format stay in MLX
HOST_CACHE_ENV = "BATCHMLX_HOST_CACHE"  # 0: no packed-weights file between starts
ONEDNN_LIB_ENV = "BATCHMLX_ONEDNN_LIB"  # an explicit path to libdnnl.so.3*
# images and videos of vision lines (worker/media.py; docs/requests.md)
MEDIA_DIR_ENV = "BATCHMLX_MEDIA_DIR"  # the one folder file images may be read from
MEDIA_FETCH_ENV = "BATCHMLX_MEDIA_FETCH"  # off/0/false/no: https images refused, never fetched
# 1/true/yes/on: https images may come from loopback, private and link-local addresses
MEDIA_FETCH_PRIVATE_ENV = "BATCHMLX_MEDIA_FETCH_PRIVATE"


@dataclass(frozen=True, slots=True)
class HostSettings:
    """The CPU backend's switches, read here once and handed to the HostBackend the worker
    builds (engine/host/backend.py); nothing under engine/host/ reads the environment."""

    threads: int | None = None  # $BATCHMLX_THREADS (--threads wins); None: chosen from the load
    host_steps: bool = True  # $BATCHMLX_HOST_STEPS (0/false/no/off: off; engine/host/step.py)
    weights_cache: bool = True  # $BATCHMLX_HOST_CACHE (0: off; engine/host/weights_cache.py)
    onednn_library: str | None = None  # $BATCHMLX_ONEDNN_LIB, tried before the Python prefixes


@dataclass(frozen=True, slots=True)
class MediaSettings:
    """Where a vision line's https and file images may come from, read here once and handed to
    the worker's media reader (worker/media.py); nothing under worker/ reads the environment."""

    media_dir: Path | None = None  # $BATCHMLX_MEDIA_DIR (resolved); None: file parts refused
    fetch: bool = True  # $BATCHMLX_MEDIA_FETCH (off: https parts refused, never fetched)
    # $BATCHMLX_MEDIA_FETCH_PRIVATE: fetch from loopback, private (RFC 1918, unique-local),
    # link-local and other non-global addresses too; off: only global addresses
    fetch_private: bool = False


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
    database_password_file: Path | None = None  # $BATCHMLX_DATABASE_PASSWORD_FILE
    # $BATCHMLX_RETENTION_DAYS: finished batches older than this are purged; None: kept
    retention_days: float | None = None
    # docs/models.md: names that are no model here are served by the serving model, refused
    # when strict ($BATCHMLX_STRICT_MODELS, --strict-models); aliases send a name to a model
    # ($BATCHMLX_MODEL_ALIASES, --model-alias NAME=MODEL)
    strict_models: bool = False
    model_aliases: tuple[tuple[str, str], ...] = ()
    cpu: HostSettings = HostSettings()  # the CPU backend's switches (load_host_settings)
    media: MediaSettings = MediaSettings()  # vision lines' images (load_media_settings)

    @property
    def db_path(self) -> Path:
        return self.home / "batchmlx.db"

    @property
    def database_url(self) -> str:
        return self.database or f"sqlite:///{self.db_path}"

    @property
    def target(self) -> Target:
        """The database URL parsed (with the password file's password): ask it for the
        dialect. Raises DatabaseUrlError (no password in its message)."""
        pw = self.database_password_file
        password = None if pw is None else read_password_file(pw)
        return parse_target(self.database_url, password=password)

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
    env: Mapping[str, str] | None = None,
    *,
    database_url: str | None = None,
    password_file: Path | None = None,
) -> Settings:
    """Settings from the environment (default: this process's); `database_url` and
    `password_file`, parsed from the command line, are passed down in them rather than through
    the environment. A value that is no number raises ValueError naming its variable."""
    env = os.environ if env is None else env
    home = Path(env.get("BATCHMLX_HOME") or DEFAULT_HOME).expanduser()
    cache = Path(env.get("BATCHMLX_CACHE_DIR") or home / "cache").expanduser()
    pw = password_file or env.get(PASSWORD_FILE_ENV) or None
    return Settings(
        home=home,
        cache_dir=cache,
        lease_s=_number(env, "BATCHMLX_LEASE_S", positive=True) or DEFAULT_LEASE_S,
        database=database_url or env.get(DATABASE_URL_ENV) or None,
        host=env.get("BATCHMLX_WORKER_HOST") or None,
        file_storage=env.get("BATCHMLX_FILE_STORAGE") or None,
        busy_timeout_s=_number(env, "BATCHMLX_BUSY_TIMEOUT_S"),
        database_password_file=None if pw is None else Path(pw),
        retention_days=_number(env, RETENTION_DAYS_ENV),
        strict_models=truthy(env.get(STRICT_MODELS_ENV)),
        model_aliases=tuple(
            parse_aliases(
                split_aliases(env.get(MODEL_ALIASES_ENV) or ""), what=f"${MODEL_ALIASES_ENV}"
            ).items()
        ),  # fmt: skip
        cpu=load_host_settings(env),
        media=load_media_settings(env),
    )


def load_host_settings(env: Mapping[str, str] | None = None) -> HostSettings:
    """The CPU backend's switches from the environment (default: this process's). A thread
    count that is no whole number raises ValueError naming its variable."""
    env = os.environ if env is None else env
    threads = None
    if env.get(THREADS_ENV, "").strip():
        try:
            threads = int(env[THREADS_ENV])
        except ValueError:
            msg = f"{THREADS_ENV} must be a whole number of threads, not {env[THREADS_ENV]!r}"
            raise ValueError(msg) from None
    off = ("0", "false", "no", "off")
    return HostSettings(
        threads=threads,
        host_steps=env.get(HOST_STEPS_ENV, "1").strip().lower() not in off,
        weights_cache=env.get(HOST_CACHE_ENV, "1").strip() != "0",
        onednn_library=env.get(ONEDNN_LIB_ENV) or None,
    )


def load_media_settings(env: Mapping[str, str] | None = None) -> MediaSettings:
    """Where vision lines' images may come from, from the environment (default: this
    process's)."""
    env = os.environ if env is None else env
    folder = env.get(MEDIA_DIR_ENV)
    return MediaSettings(
        media_dir=Path(folder).expanduser().resolve() if folder else None,
        fetch=env.get(MEDIA_FETCH_ENV, "").strip().lower() not in ("off", "0", "false", "no"),
        fetch_private=truthy(env.get(MEDIA_FETCH_PRIVATE_ENV)),
    )


def _number(env: Mapping[str, str], name: str, *, positive: bool = False) -> float | None:
    """The variable `name` as a number (None when unset or empty)."""
    text = env.get(name)
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"${name} must be a {'positive' if positive else 'non-negative'} "
                         f"number, not {text!r}")  # fmt: skip
    return value


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
