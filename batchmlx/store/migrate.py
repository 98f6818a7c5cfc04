"""Apply the Alembic migrations (the top-level `migrations/` folder, installed as the package
`batchmlx.migrations`), once, on first use.

Alembic is configured in code (no alembic.ini at run time). The same migrations run on SQLite and
PostgreSQL. Two processes opening a fresh database at once are serialised: on SQLite by an
exclusive `flock` on `<db>.migrate.lock`, on PostgreSQL by an advisory lock taken in the
migration's transaction (migrations/env.py), since hosts share no disk. A SQLite database
already at the newest revision is left alone without Alembic (importing and running it costs
about 0.1 s of every command).
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

from batchmlx.config import PRIVATE_FILE_MODE
from batchmlx.database_url import Target, parse_target

if TYPE_CHECKING:
    from alembic.config import Config


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
    from alembic.config import Config

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
    if t.is_sqlite and t.path is not None and _sqlite_at(t.path, head_revision()):
        return
    from alembic import command

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


_REVISION = re.compile(r"^revision(?:: str)? = [\"'](\w+)[\"']$", re.M)
_DOWN = re.compile(r"^down_revision(?:: [\w| ]+)? = (?:None|[\"'](\w+)[\"'])$", re.M)


def head_revision() -> str | None:
    """The one newest revision of the migrations folder, read from the version files as they are
    written (`revision = "0003"`, `down_revision = "0002"`); None where that reading is not
    sure (a file in another form, branches), and Alembic decides."""
    revisions, downs = set(), set()
    for path in (MIGRATIONS_DIR / "versions").glob("*.py"):
        text = path.read_text()
        rev, down = _REVISION.findall(text), _DOWN.findall(text)
        if len(rev) != 1 or len(down) != 1:
            return None
        revisions.add(rev[0])
        downs.add(down[0])
    heads = revisions - downs
    return heads.pop() if len(heads) == 1 else None


def _sqlite_at(path: Path, revision: str | None) -> bool:
    """Whether the SQLite database at `path` exists and is at `revision` (read only)."""
    if revision is None or not path.is_file():
        return False
    try:
        con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            rows = con.execute("SELECT version_num FROM alembic_version").fetchall()
        finally:
            con.close()
    except sqlite3.Error:
        return False
    return rows == [(revision,)]
