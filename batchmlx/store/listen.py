"""Wake-ups for idle workers: PostgreSQL's LISTEN on one connection the store keeps open."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine


class Listener:
    """LISTENs on `channel`; `wait` returns early when a NOTIFY arrives. Opened lazily, so
    processes that never wait (the CLI) hold no extra connection."""

    def __init__(self, engine: AsyncEngine, channel: str) -> None:
        self._engine = engine
        self._channel = channel
        self._conn: AsyncConnection | None = None
        self._raw: Any = None  # the asyncpg connection under _conn
        self._event = asyncio.Event()

    def _on_notify(self, *_args: Any) -> None:
        self._event.set()

    async def _ensure(self) -> None:
        if self._raw is not None and not self._raw.is_closed():
            return
        await self.close()  # a connection the server dropped: start over
        self._conn = await self._engine.connect()
        self._raw = (await self._conn.get_raw_connection()).driver_connection
        await self._raw.add_listener(self._channel, self._on_notify)
        self._event.set()  # anything sent before we listened (or while away): look once

    async def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout`; True when woken by a notification."""
        try:
            await self._ensure()
        except Exception:  # the database is away: sleep, the next call reconnects
            await self.close()
            await asyncio.sleep(timeout)
            return False
        try:
            await asyncio.wait_for(self._event.wait(), timeout)
        except TimeoutError:
            return False
        self._event.clear()
        return True

    async def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.invalidate()  # not back to the pool: it was LISTENing
            with contextlib.suppress(Exception):
                await self._conn.close()
        self._conn = self._raw = None
