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
from typing import Any, Protocol

from sqlalchemy import delete, func, insert, literal, literal_column, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.sql import ColumnElement

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


class FileChanged(FileNotFoundError):
    """A file's bytes were deleted or replaced while they were read (between two chunks)."""


def _version(conn: AsyncConnection) -> ColumnElement[Any]:
    """What tells one write of a file's chunks from the next: on PostgreSQL the writing
    transaction (xmin), the same for every chunk of one `put`. SQLite keeps file bytes on
    disk (a database copy is for tests), and its rowids are reused: no check there."""
    if conn.dialect.name == "postgresql":
        return literal_column("xmin::text")
    return literal(None)


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
        # SQLAlchemy fetches 50 rows (50 MiB here) at a time whatever yield_per says. And one
        # short transaction per chunk: a reader that takes minutes (a slow client) must not
        # hold a pooled connection all that time, or 16 of them starve every other request.
        # A replace between two chunks is caught by the version of the chunk rows (the one
        # transaction that wrote them all): the read fails rather than mixing old and new.
        count, version = None, None
        seq = 0
        while count is None or seq < count:
            async with self._reader.connect() as conn:
                if count is None:
                    count = (await conn.execute(select(func.count()).where(
                        FILE_CHUNKS.c.file_id == file_id))).scalar_one()  # fmt: skip
                    if not count:
                        return
                row = (await conn.execute(
                    select(FILE_CHUNKS.c.data, _version(conn)).where(
                        FILE_CHUNKS.c.file_id == file_id, FILE_CHUNKS.c.seq == seq)
                )).first()  # fmt: skip
            if row is None or (version is not None and row[1] != version):
                raise FileChanged(f"file {file_id} was deleted or replaced while it was read")
            version = row[1]
            yield row[0]
            seq += 1

    async def delete(self, file_id: str, location: str) -> None:
        async with self._engine.begin() as conn:
            await conn.execute(delete(FILE_CHUNKS).where(FILE_CHUNKS.c.file_id == file_id))
