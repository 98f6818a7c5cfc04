"""Run an async scenario against a real store in a fresh home (tests that drive services)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from batchmlx.config import Settings
from batchmlx.store import Store


def run_with_store(tmp_path: Path, scenario) -> None:
    """`await scenario(store, settings)` on a new SQLite file under tmp_path/home."""
    settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache")

    async def main() -> None:
        store = await Store.open(settings.db_path)
        try:
            await scenario(store, settings)
        finally:
            await store.close()

    asyncio.run(main())
