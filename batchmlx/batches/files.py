"""Files under files/ and their records: written atomically, never one without the other."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from batchmlx.batches.errors import BatchError
from batchmlx.config import Settings, private_dir
from batchmlx.core.records import FileRecord
from batchmlx.faults import crash_point
from batchmlx.formats.openai import IdPrefix, new_id
from batchmlx.store import Store


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


async def store_file(
    store: Store,
    settings: Settings,
    data: bytes,
    *,
    filename: str,
    purpose: str,
    now: float,
    file_id: str | None = None,
) -> FileRecord:
    """Write `data` under files/ and record it; a given `file_id` replaces that file."""
    replace = file_id is not None
    file_id = file_id or new_id(IdPrefix.FILE)
    path = settings.files_dir / file_id
    crash_point("store_file")
    write_atomic(path, data)
    rec = FileRecord(file_id, text_name(filename), purpose, len(data), int(now), str(path))
    try:
        await store.add_file(rec, replace=replace)
    except BaseException:
        if not replace:
            path.unlink(missing_ok=True)  # no bytes under files/ without their record
        raise
    return rec


async def file_content(store: Store, file_id: str | None) -> bytes:
    if file_id is None:
        return b""
    f = await store.get_file(file_id)
    if f is None:
        raise BatchError(f"no file with id {file_id!r}")
    return Path(f.path).read_bytes()


async def delete_file(store: Store, file_id: str) -> bool:
    """Forget a file and remove its bytes; False when there is no such file."""
    rec = await store.delete_file(file_id)
    if rec is None:
        return False
    Path(rec.path).unlink(missing_ok=True)
    return True
