"""The data directory holds every prompt and answer: under the usual umask its folders are
0700 and its files 0600, the database's -wal and -shm files included."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

from batchmlx import batches
from batchmlx.config import load_settings
from batchmlx.store import Store


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_fresh_home_is_the_users_alone(tmp_path):
    settings = load_settings({"BATCHMLX_HOME": str(tmp_path / "a" / "b" / "home")})

    async def scenario() -> set[str]:
        store = await Store.open(settings.db_path)
        try:
            await batches.files.store_file(store, settings, b"{}\n", filename="x.jsonl",
                                     purpose="batch", now=1.0)  # fmt: skip
            return {p.name for p in settings.home.iterdir()}  # while the database is open
        finally:
            await store.close()

    old = os.umask(0o022)
    try:
        names = asyncio.run(scenario())
        seen = {p: _mode(p) for p in (tmp_path / "a").rglob("*")}
    finally:
        os.umask(old)
    assert {"batchmlx.db", "batchmlx.db-wal", "batchmlx.db-shm", "files"} <= names, names
    assert _mode(tmp_path / "a") == 0o700
    for path, mode in seen.items():
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


def test_an_existing_folder_keeps_its_mode(tmp_path):
    home = tmp_path / "home"
    home.mkdir(mode=0o750)
    home.chmod(0o750)  # the user's choice: batchmlx only sets what it creates
    asyncio.run(_open_close(home / "batchmlx.db"))
    assert _mode(home) == 0o750 and _mode(home / "batchmlx.db") == 0o600


async def _open_close(db: Path) -> None:
    await (await Store.open(db)).close()
