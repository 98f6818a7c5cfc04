"""Apply the Alembic migrations (the top-level `migrations/` folder, installed as the package
`batchmlx.migrations`), once, on first use.

Alembic is configured in code (no alembic.ini at run time). Two processes opening a fresh
database at once are serialised by an exclusive `flock` on `<db>.migrate.lock`.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from alembic import command
from alembic.config import Config

from batchmlx.config import PRIVATE_FILE_MODE


def _migrations_dir() -> Path:
    # Installed (wheel or editable): setup.py maps <repo>/migrations to batchmlx.migrations. A
    # checkout run without installing (PYTHONPATH=<repo>) has only the folder beside the package.
    try:
        import batchmlx.migrations as package

        return Path(package.__file__).resolve().parent
    except ImportError:
        return Path(__file__).resolve().parents[2] / "migrations"


MIGRATIONS_DIR = _migrations_dir()


def alembic_config(db_path: str | Path) -> Config:
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise RuntimeError(f"batchmlx migrations not found at {MIGRATIONS_DIR}")
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    url = f"sqlite:///{Path(db_path).resolve()}"
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade_to_head(db_path: str | Path) -> None:
    """Bring the database at `db_path` to the newest revision; a no-op when it is there already."""
    db_path = Path(db_path)
    lock_path = db_path.with_name(db_path.name + ".migrate.lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, PRIVATE_FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        command.upgrade(alembic_config(db_path), "head")
    finally:
        os.close(fd)  # closing releases the lock
