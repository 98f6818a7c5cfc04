"""Files: their records (the `files` table) and their bytes (blobs.py: a local folder or chunks
in the database), kept together so no bytes outlive their record."""

from __future__ import annotations

from collections.abc import AsyncIterator

from sqlalchemy import delete, select

from batchmlx.core.records import FileRecord
from batchmlx.store.base import StoreBase, rows_after
from batchmlx.store.blobs import Chunks
from batchmlx.store.rows import F, file_record, file_values


class FilesPart(StoreBase):
    """The file operations of `Store`."""

    async def add_file(self, rec: FileRecord, *, replace: bool = False) -> None:
        """Record a stored file; with `replace`, a record with the same id is overwritten
        (finalize redone after a crash derives the same file ids)."""
        values = file_values(rec)
        stmt = self._sql.insert(F).values(**values)
        if replace:
            stmt = stmt.on_conflict_do_update(
                index_elements=[F.c.id], set_={k: v for k, v in values.items() if k != "id"}
            )
        async with self._engine.begin() as conn:
            await conn.execute(stmt)

    async def save_file(
        self,
        file_id: str,
        chunks: Chunks,
        *,
        filename: str,
        purpose: str,
        created_at: int,
        replace: bool = False,
        expires_at: int | None = None,
    ) -> FileRecord:
        """Store a file's bytes (streamed, atomically) and record it; see `add_file`. A file
        with `expires_at` is deleted by the worker's housekeeping once that time has passed."""
        size, location = await self.blobs.put(file_id, chunks)
        rec = FileRecord(file_id, filename, purpose, size, created_at, location, expires_at)
        try:
            await self.add_file(rec, replace=replace)
        except BaseException:
            if not replace:  # no stored bytes without their record
                await self.blobs.delete(file_id, location)
            raise
        return rec

    def read_file(self, rec: FileRecord) -> AsyncIterator[bytes]:
        """A stored file's bytes, in chunks."""
        return self.blobs.read(rec.id, rec.path)

    async def read_file_bytes(self, rec: FileRecord) -> bytes:
        """A stored file's bytes at once (for files known to be small, or validation)."""
        return b"".join([c async for c in self.read_file(rec)])

    async def delete_file_bytes(self, rec: FileRecord) -> None:
        await self.blobs.delete(rec.id, rec.path)

    async def get_file(self, file_id: str) -> FileRecord | None:
        async with self._reader.connect() as conn:
            row = (await conn.execute(select(F).where(F.c.id == file_id))).mappings().first()
        return None if row is None else file_record(row)

    async def list_files_page(
        self,
        *,
        purpose: str | None = None,
        limit: int = 10_000,
        order: str = "desc",
        after: str | None = None,
    ) -> list[FileRecord]:
        """A page of files by creation time (`order` "asc" or "desc"); `after` is the id of the
        last file of the previous page. An unknown `after` gives an empty page."""
        seq = self._sql.file_seq
        desc = order == "desc"
        query = select(F).order_by(
            *((F.c.created_at.desc(), seq.desc()) if desc else (F.c.created_at, seq))
        )
        if purpose is not None:
            query = query.where(F.c.purpose == purpose)
        async with self._reader.connect() as conn:
            if after is not None:
                beyond = await rows_after(conn, F, seq, after, desc=desc)
                if beyond is None:
                    return []
                query = query.where(beyond)
            rows = (await conn.execute(query.limit(limit))).mappings().all()
        return [file_record(r) for r in rows]

    async def expired_files(self, now: float) -> list[FileRecord]:
        """Files whose `expires_at` has passed, oldest expiry first."""
        query = select(F).where(F.c.expires_at <= int(now)).order_by(F.c.expires_at)
        async with self._reader.connect() as conn:
            rows = (await conn.execute(query)).mappings().all()
        return [file_record(r) for r in rows]

    async def delete_file(self, file_id: str) -> FileRecord | None:
        """Forget a file's record; returns it (None when unknown). The bytes are the caller's."""
        async with self._engine.begin() as conn:
            row = (await conn.execute(select(F).where(F.c.id == file_id))).mappings().first()
            if row is None:
                return None
            await conn.execute(delete(F).where(F.c.id == file_id))
        return file_record(row)
