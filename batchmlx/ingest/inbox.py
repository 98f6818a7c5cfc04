"""The inbox: every `*.jsonl` dropped in a folder becomes a batch (layout in ingest/layout.py).

A file is taken once its writer is done: no process holds it open for writing (where /proc
tells), and it is unchanged (size and mtime) for `settle_s` and ends in a newline, or unchanged
for three times `settle_s` (a last line without newline). Names starting with "." are ignored,
so a writer may also write `.name.jsonl.part` and rename it. The same content (sha256) as a
batch that ran or runs with the same model is not submitted again unless `force`; the content
of a failed, cancelled or expired batch is. A file that cannot be taken (a symlink, a name that
is not UTF-8, an unreadable file, one the store refuses) goes to failed/ with a reason, so no
file is ever copied twice; a database that is busy or away refuses nothing: the file stays and
is tried again at the next scan. The file is moved aside only after its batch is committed; the
batch's `source` names the drop, so a restart after a crash in between moves the file instead
of resubmitting.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import BinaryIO

import orjson
from watchfiles import awatch

from batchmlx.batches.errors import BatchError
from batchmlx.batches.files import CHUNK_BYTES, text_name, write_atomic
from batchmlx.batches.intake import submit, validate_batch
from batchmlx.batches.models import dedup_key, expected_model, rule_of
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.records import BatchErrorRecord, BatchRecord
from batchmlx.faults import crash_point
from batchmlx.formats.errors import ErrorCode, errors_object
from batchmlx.ingest.layout import DONE, FAILED, RESULTS, Drop
from batchmlx.ingest.writers import open_for_writing
from batchmlx.store import Store
from batchmlx.store.errors import is_transient_db_error

log = logging.getLogger("batchmlx.inbox")

# batches whose content is not submitted again: they ran, run or will run
_SEEN_BEFORE = (
    BatchStatus.VALIDATING,
    BatchStatus.IN_PROGRESS,
    BatchStatus.FINALIZING,
    BatchStatus.COMPLETED,
)


class Inbox:
    def __init__(
        self,
        settings: Settings,
        folder: Path,
        *,
        settle_s: float = 1.0,
        force: bool = False,
        model: str | None = None,
        completion_window: str = "24h",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.folder = Path(folder).expanduser().resolve()
        self.settle_s = settle_s
        self.force = force
        self.model = model
        self.completion_window = completion_window
        self.clock = clock
        self._seen: dict[Path, tuple[int, int]] = {}  # path -> (size, mtime_ns) last scan

    async def run(self, store: Store, stop: asyncio.Event) -> None:
        """Ingest what is there, then watch until `stop` is set."""
        for sub in (DONE, FAILED, RESULTS):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        log.info("watching %s", self.folder)
        await self._scan_logged(store)
        tick_ms = max(50, int(self.settle_s * 500))
        async for _ in awatch(
            self.folder, stop_event=stop, recursive=False, debounce=tick_ms,
            rust_timeout=tick_ms, yield_on_timeout=True,
        ):  # fmt: skip
            await self._scan_logged(store)

    async def _scan_logged(self, store: Store) -> None:
        try:  # the watch outlives a scan that fails (each file's faults are caught in scan)
            await self.scan(store)
        except Exception:
            log.exception("scanning %s failed; tried again at the next change", self.folder)

    async def scan(self, store: Store) -> list[BatchRecord]:
        """One pass over the folder: ingest every complete file; returns the batches made."""
        now = self.clock()
        present: set[Path] = set()
        ready: list[tuple[Path, os.stat_result]] = []
        with os.scandir(self.folder) as entries:
            found = sorted(
                (e for e in entries if e.name.endswith(".jsonl") and not e.name.startswith(".")),
                key=lambda e: e.name,
            )
        for entry in found:
            path = self.folder / entry.name
            try:
                if entry.is_symlink():  # never follow: any file we can read would be copied
                    _refuse(path, "it is a symbolic link; drop the file itself")
                    continue
                if not entry.is_file(follow_symlinks=False):
                    _refuse(path, "it is not a regular file")
                    continue
                st = entry.stat(follow_symlinks=False)
            except OSError as exc:  # gone meanwhile, or failed/ cannot be written
                log.warning("%s: %s", text_name(entry.name), exc)
                continue
            present.add(path)
            key = (st.st_size, st.st_mtime_ns)
            first, prev = path not in self._seen, self._seen.get(path)
            self._seen[path] = key
            quiet = now - st.st_mtime
            if (not first and prev != key) or quiet < self.settle_s:
                continue  # still being written
            if quiet < 3 * self.settle_s and not _ends_in_newline(path, st.st_size):
                continue  # maybe a line is half-written
            ready.append((path, st))
        writing = open_for_writing(p for p, _ in ready) if ready else set()
        made: list[BatchRecord] = []
        for path, st in ready:
            if path in writing:
                continue  # its writer may only be pausing
            try:
                rec = await self.ingest(store, path, st)
            except Exception as exc:  # one bad file never stops the inbox
                if is_transient_db_error(exc):  # the file stays; the next scan takes it
                    log.warning("%s: the database is unavailable (%s); the file stays in the "
                                "inbox and is tried again", text_name(path.name),
                                getattr(exc, "orig", None) or exc)  # fmt: skip
                else:
                    log.exception("cannot ingest %s", text_name(path.name))
                continue
            self._seen.pop(path, None)
            if rec is not None:
                made.append(rec)
        for gone in set(self._seen) - present:
            del self._seen[gone]
        return made

    async def ingest(
        self, store: Store, path: Path, st: os.stat_result | None = None
    ) -> BatchRecord | None:
        """Make a batch of `path` (or find its duplicate) and move the file aside."""
        name = text_name(path.name)
        if name != path.name:
            _refuse(path, "its name is not valid UTF-8; rename it")
            return None
        drop = Drop.of(path, st if st is not None else path.lstat())
        prior = await store.find_batch_by_source(drop.source)
        if prior is not None:  # taken before a crash kept it from moving: move it now
            log.info("%s: already batch %s; moved aside", name, prior.id)
            if prior.status is BatchStatus.VALIDATING:  # the crash came between create and validate
                prior = await validate_batch(
                    store, self.settings, prior.id, now=self.clock(), model=self.model
                )
            self._put_away(path, prior)
            return None
        try:
            f = _open_no_follow(path)
        except OSError as exc:
            _refuse(path, f"it cannot be read: {exc.strerror}")
            return None
        with f:  # read twice, a chunk at a time: hashed for the duplicate check, then stored
            try:
                digest = hashlib.file_digest(f, "sha256").hexdigest()
                f.seek(0)
                body_model = _first_body_model(f)
                f.seek(0)
            except OSError as exc:
                _refuse(path, f"it cannot be read: {exc.strerror}")
                return None
            if not self.force:  # the same content run with another model is no duplicate
                model = expected_model(body_model, self.model, rule_of(self.settings))
                dup = await store.find_batch_by_hash(dedup_key(digest, model), _SEEN_BEFORE)
                if dup is not None:
                    log.info("%s: same content as %s; not submitted again", name, dup.id)
                    _move(path, self.folder / DONE)
                    return None
            try:
                rec = await submit(
                    store, self.settings, iter(partial(f.read, CHUNK_BYTES), b""),
                    filename=name, now=self.clock(), model=self.model,
                    completion_window=self.completion_window, source=drop.source,
                )  # fmt: skip
            except BatchError as exc:  # e.g. an unknown --model: the file is not at fault
                log.error("%s: %s", name, exc)
                return None
            except Exception as exc:  # submit left nothing behind; the file must not come back
                if is_transient_db_error(exc):
                    raise  # nothing wrong with the file: left in place, tried again
                log.exception("%s: cannot be submitted", name)
                _refuse(path, f"it cannot be submitted: {exc}")
                return None
        crash_point("inbox_after_submit")
        self._put_away(path, rec)
        return rec

    def _put_away(self, path: Path, rec: BatchRecord) -> None:
        if rec.status is BatchStatus.FAILED:
            report = _refuse(path, None, rec)
            log.warning("%s: failed validation; see %s", path.name, report)
        else:
            _move(path, self.folder / DONE)
            log.info("%s: batch %s, %d requests", path.name, rec.id, rec.request_counts.total)


_PEEK_BYTES = 16 * 1024 * 1024  # a first line longer than this is not read for its model


def _first_body_model(f: BinaryIO) -> object:
    """The `body.model` of the file's first request (None where it has none): the duplicate
    check's model, read before the file is validated."""
    for _ in range(100):  # blank lines before the first request
        line = f.readline(_PEEK_BYTES).removeprefix(b"\xef\xbb\xbf").strip()
        if line:
            break
    else:
        return None
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None  # malformed (or too long): the batch fails, or its key has no model
    body = obj.get("body") if isinstance(obj, dict) else None
    return body.get("model") if isinstance(body, dict) else None


def _open_no_follow(path: Path) -> BinaryIO:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    return os.fdopen(fd, "rb")


def _refuse(path: Path, reason: str | None, rec: BatchRecord | None = None) -> Path:
    """Move `path` to failed/ beside NAME.errors.json: the batch's errors, or `reason`."""
    failed = path.parent / FAILED
    dest = _free_name(failed, path.name)
    if rec is not None:
        errors = rec.errors
    else:
        errors = (BatchErrorRecord(ErrorCode.FILE_REFUSED.value, f"Not taken: {reason}."),)
        log.warning("%s: not taken: %s", text_name(path.name), reason)
    body = {
        "batch_id": rec.id if rec else None,
        "file": text_name(path.name),
        "errors": errors_object(errors),
    }
    report = failed / f"{dest.stem}.errors.json"
    write_atomic(report, orjson.dumps(body, option=orjson.OPT_INDENT_2) + b"\n")
    os.replace(path, dest)  # a symlink moves as a link; its target is never read
    return report


def _ends_in_newline(path: Path, size: int) -> bool:
    if size == 0:
        return False
    try:
        with path.open("rb") as f:
            f.seek(size - 1)
            return f.read(1) == b"\n"
    except OSError:
        return False


def _free_name(folder: Path, name: str) -> Path:
    """`folder/name`, or `folder/stem.N.suffix` when an earlier file took that name."""
    folder.mkdir(parents=True, exist_ok=True)
    dest, stem, suffix = folder / name, Path(name).stem, Path(name).suffix
    n = 1
    while os.path.lexists(dest) or os.path.lexists(folder / f"{dest.stem}.errors.json"):
        dest = folder / f"{stem}.{n}{suffix}"
        n += 1
    return dest


def _move(path: Path, folder: Path) -> Path:
    """Move `path` into `folder`, never over an earlier file of the same name."""
    dest = _free_name(folder, path.name)
    os.replace(path, dest)
    return dest
