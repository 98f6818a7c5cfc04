"""Files and their records, never one without the other: the bytes go through the store's blob
seam (under files/ with SQLite, in the database with PostgreSQL) and stream back in chunks."""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from batchmlx.batches.errors import BatchError
from batchmlx.config import Settings, private_dir
from batchmlx.core.records import FileRecord
from batchmlx.faults import crash_point
from batchmlx.formats.openai import IdPrefix, new_id
from batchmlx.store import Store
from batchmlx.store.blobs import CHUNK_BYTES, Chunks, LocalBlobs, aiter_chunks


def write_atomic(path: Path, data: bytes) -> None:
    """Write to a temporary file, flush it to disk, then rename: readers see all or nothing.
    The file is the owner's alone (mkstemp's 0600), and so is a folder made for it."""
    private_dir(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def text_name(name: str) -> str:
    """A file name as text the store can keep: bytes that are not UTF-8 (surrogate-escaped by
    the OS layer) shown as \\xNN."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that no file name produced
        return name.encode("utf-8", "backslashreplace").decode()


class Hashed:
    """Chunks passed through unchanged while their SHA-256 is computed (`hexdigest` once
    they are all read): one pass over a file that is stored and hashed."""

    def __init__(self, chunks: bytes | Chunks) -> None:
        self._chunks: Chunks = [chunks] if isinstance(chunks, bytes) else chunks
        self._sha = hashlib.sha256()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in aiter_chunks(self._chunks):
            self._sha.update(chunk)
            yield chunk

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def read_chunks(path: Path, size: int = CHUNK_BYTES) -> Iterator[bytes]:
    """A local file's bytes in chunks (the CLI's submit)."""
    with open(path, "rb") as f:
        while chunk := f.read(size):
            yield chunk


async def store_file(
    store: Store,
    settings: Settings,
    data: bytes | Chunks,
    *,
    filename: str,
    purpose: str,
    now: float,
    file_id: str | None = None,
    expires_after: int | None = None,
) -> FileRecord:
    """Store `data` (bytes, or chunks streamed in) under files/ or in the database, and record
    it; a given `file_id` replaces that file. With `expires_after` (seconds) the worker deletes
    it that long after `now`."""
    replace = file_id is not None
    file_id = file_id or new_id(IdPrefix.FILE)
    crash_point("store_file")
    expires_at = None if expires_after is None else int(now) + expires_after
    return await store.save_file(
        file_id, [data] if isinstance(data, bytes) else data, filename=text_name(filename),
        purpose=purpose, created_at=int(now), replace=replace, expires_at=expires_at,
    )  # fmt: skip


async def file_content(store: Store, file_id: str | None) -> bytes:
    return b"".join([c async for c in iter_file_content(store, file_id)])


async def iter_file_content(store: Store, file_id: str | None) -> AsyncIterator[bytes]:
    """A file's bytes in chunks, wherever they are stored (a 200 MB file is never whole)."""
    if file_id is None:
        return
    f = await store.get_file(file_id)
    if f is None:
        raise BatchError(f"no file with id {file_id!r}")
    async for chunk in store.read_file(f):
        yield chunk


async def copy_file(store: Store, file_id: str | None, path: Path) -> int:
    """Write a stored file to `path` (empty for None), streamed and atomically; its size."""
    return (await LocalBlobs(path.parent).put(path.name, iter_file_content(store, file_id)))[0]


async def delete_file(store: Store, file_id: str) -> bool:
    """Forget a file and remove its bytes, and the request contents of a finished batch it
    held (its prompts, responses or errors: the rows keep counts and usage); False when there
    is no such file."""
    rec = await store.delete_file(file_id)
    if rec is None:
        return False
    await store.delete_file_bytes(rec)
    await store.forget_contents(await store.orphaned_contents(file_ids=[file_id]))
    return True


async def delete_expired_files(store: Store, *, now: float) -> list[str]:
    """Delete every file past its `expires_at`, record and bytes, wherever the bytes are stored,
    with the contents it held in the database (see `delete_file`; the worker's housekeeping);
    returns their ids."""
    gone = []
    for f in await store.expired_files(now):
        if await delete_file(store, f.id):
            gone.append(f.id)
    return gone
