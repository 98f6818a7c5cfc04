"""Apply the Alembic migrations (the top-level `migrations/` folder, installed as the package
`batchmlx.migrations`), once, on first use.

Alembic is configured in code (no alembic.ini at run time). The same migrations run on SQLite and
PostgreSQL. Two processes opening a fresh database at once are serialised: on SQLite by an
exclusive `flock` on `<db>.migrate.lock`, on PostgreSQL by an advisory lock taken in the
migration's transaction (migrations/env.py), since hosts share no disk.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from alembic import command
from alembic.config import Config

from batchmlx.config import PRIVATE_FILE_MODE
from batchmlx.database_url import Target, parse_target


def _migrations_dir() -> Path:
    # Installed (wheel or editable): setup.py maps <repo>/migrations to batchmlx.migrations. A
    # checkout run without installing (PYTHONPATH=<repo>) has only the folder beside the package.
    try:
        import batchmlx.migrations as package

        return Path(package.__file__).resolve().parent
    except ImportError:
        return Path(__file__).resolve().parents[2] / "migrations"


MIGRATIONS_DIR = _migrations_dir()
# Alembic says "Context impl SQLiteImpl." and "Will assume non-transactional DDL." at INFO on
# every open, into the log of each worker and server: nothing a user can act on. Warnings only.
logging.getLogger("alembic").setLevel(logging.WARNING)
# pg_advisory_xact_lock key serialising concurrent upgrades ("bmlx" in ASCII)
MIGRATE_LOCK_KEY = 0x626D6C78


def alembic_config(target: str | Path | Target) -> Config:
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise RuntimeError(f"batchmlx migrations not found at {MIGRATIONS_DIR}")
    t = target if isinstance(target, Target) else parse_target(target)
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    cfg.set_main_option("sqlalchemy.url", t.migration_url.replace("%", "%%"))
    return cfg


def upgrade_to_head(target: str | Path | Target) -> None:
    """Bring the database to the newest revision; a no-op when it is there already."""
    t = target if isinstance(target, Target) else parse_target(target)
    if t.is_postgresql:
        command.upgrade(alembic_config(t), "head")
        return
    assert t.path is not None
    lock_path = t.path.with_name(t.path.name + ".migrate.lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        command.upgrade(alembic_config(t), "head")
    finally:
        os.close(fd)  # closing releases the lock
