"""Where file bytes live: a folder on this host's disk, or chunks in the database.

Both write atomically (readers see the old bytes or the new, never part of a write) and stream:
a file goes in and comes out in chunks, so a 200 MB file is never held in memory whole.
With PostgreSQL, hosts share nothing but the database, so the bytes live there (`file_chunks`);
with SQLite, in `$BATCHMLX_HOME/files` as before.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from pathlib import Path
from typing import Protocol

from sqlalchemy import delete, insert, select
from sqlalchemy.ext.asyncio import AsyncEngine

from batchmlx.config import private_dir
from batchmlx.store.models import FILE_CHUNKS

CHUNK_BYTES = 1 << 20  # one row of file_chunks, one read of a local file
DB_PREFIX = "db:"  # FileRecord.path of a file kept in the database

Chunks = Iterable[bytes] | AsyncIterable[bytes]


async def aiter_chunks(chunks: Chunks) -> AsyncIterator[bytes]:
    if isinstance(chunks, AsyncIterable):
        async for c in chunks:
            yield c
    else:
        for c in chunks:
            yield c


async def rechunk(chunks: Chunks, size: int = CHUNK_BYTES) -> AsyncIterator[bytes]:
    """The same bytes in pieces of `size` (the last one shorter), skipping empty pieces."""
    buf = bytearray()
    async for c in aiter_chunks(chunks):
        buf += c
        while len(buf) >= size:
            yield bytes(buf[:size])
            del buf[:size]
    if buf:
        yield bytes(buf)


class Blobs(Protocol):
    async def put(self, file_id: str, chunks: Chunks) -> tuple[int, str]:
        """Store (or replace) the file's bytes atomically; returns (size, location)."""
        ...

    def read(self, file_id: str, location: str) -> AsyncIterator[bytes]:
        """The file's bytes in chunks (a local file that is gone: FileNotFoundError)."""
        ...

    async def delete(self, file_id: str, location: str) -> None: ...


class LocalBlobs:
    """Files under one folder: written to a temp file, fsynced, renamed."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    async def put(self, file_id: str, chunks: Chunks) -> tuple[int, str]:
        path = self.folder / file_id
        private_dir(path.parent)  # every prompt and answer: the user's alone
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        size = 0
        try:
            with os.fdopen(fd, "wb") as f:
                async for c in aiter_chunks(chunks):
                    f.write(c)
                    size += len(c)
                f.flush()
                await asyncio.to_thread(os.fsync, f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return size, str(path)

    async def read(self, file_id: str, location: str) -> AsyncIterator[bytes]:
        with open(location, "rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                yield chunk

    async def delete(self, file_id: str, location: str) -> None:
        Path(location).unlink(missing_ok=True)


class DatabaseBlobs:
    """Files as ordered chunks in `file_chunks`, replaced in one transaction."""

    def __init__(self, engine: AsyncEngine, reader: AsyncEngine | None = None) -> None:
        self._engine = engine
        self._reader = reader or engine

    async def put(self, file_id: str, chunks: Chunks) -> tuple[int, str]:
        size = 0
        async with self._engine.begin() as conn:
            await conn.execute(delete(FILE_CHUNKS).where(FILE_CHUNKS.c.file_id == file_id))
            seq = 0
            async for c in rechunk(chunks):
                await conn.execute(insert(FILE_CHUNKS).values(file_id=file_id, seq=seq, data=c))
                seq += 1
                size += len(c)
        return size, DB_PREFIX + file_id

    async def read(self, file_id: str, location: str) -> AsyncIterator[bytes]:
        # one chunk per query: a streamed result would not do, asyncpg's cursor under
        # SQLAlchemy fetches 50 rows (50 MiB here) at a time whatever yield_per says
        async with self._reader.connect() as conn:
            if conn.dialect.name == "postgresql":
                # one snapshot for every query: a replace while we read cannot mix old and new
                # (SQLite's read transaction is one already)
                await conn.execution_options(isolation_level="REPEATABLE READ")
            seq = 0
            while True:
                data = (
                    await conn.execute(
                        select(FILE_CHUNKS.c.data).where(
                            FILE_CHUNKS.c.file_id == file_id, FILE_CHUNKS.c.seq == seq
                        )
                    )
                ).scalar()
                if data is None:
                    return
                yield data
                seq += 1

    async def delete(self, file_id: str, location: str) -> None:
        async with self._engine.begin() as conn:
            await conn.execute(delete(FILE_CHUNKS).where(FILE_CHUNKS.c.file_id == file_id))
