"""The inbox: every `*.jsonl` dropped in a folder becomes a batch (layout in ingest/layout.py).

A file is ingested once it is complete: unchanged (size and mtime) for `settle_s` and ending in
a newline, or unchanged for three times `settle_s` (a last line without newline). Names starting
with "." are ignored, so a writer may also write `.name.jsonl.part` and rename it. The same
content twice (sha256) is one batch unless `force`. The file is moved aside only after its
batch is committed: a crash in between re-reads it on restart and finds it a duplicate.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import orjson
from watchfiles import awatch

from batchmlx import service
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.records import BatchRecord
from batchmlx.formats.errors import errors_object
from batchmlx.ingest.layout import DONE, FAILED, RESULTS, inbox_source
from batchmlx.store import Store

log = logging.getLogger("batchmlx.inbox")


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
        await self.scan(store)
        tick_ms = max(50, int(self.settle_s * 500))
        async for _ in awatch(
            self.folder, stop_event=stop, recursive=False, debounce=tick_ms,
            rust_timeout=tick_ms, yield_on_timeout=True,
        ):  # fmt: skip
            await self.scan(store)

    async def scan(self, store: Store) -> list[BatchRecord]:
        """One pass over the folder: ingest every complete file; returns the batches made."""
        made: list[BatchRecord] = []
        now = self.clock()
        present = set()
        for path in sorted(self.folder.glob("*.jsonl")):
            if path.name.startswith("."):
                continue
            try:
                st = path.stat()
            except FileNotFoundError:
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
            try:
                rec = await self.ingest(store, path)
            except Exception:  # one bad file never stops the inbox
                log.exception("cannot ingest %s", path)
                continue
            self._seen.pop(path, None)
            if rec is not None:
                made.append(rec)
        for gone in set(self._seen) - present:
            del self._seen[gone]
        return made

    async def ingest(self, store: Store, path: Path) -> BatchRecord | None:
        """Make a batch of `path` (or find its duplicate) and move the file aside."""
        data = path.read_bytes()
        if not self.force:
            dup = await store.find_batch_by_hash(hashlib.sha256(data).hexdigest())
            if dup is not None:
                log.info("%s: same content as %s; not submitted again", path.name, dup.id)
                _move(path, self.folder / DONE)
                return None
        try:
            rec = await service.submit(
                store, self.settings, data, filename=path.name, now=self.clock(),
                model=self.model, completion_window=self.completion_window,
                source=inbox_source(path),
            )  # fmt: skip
        except service.ServiceError as exc:  # e.g. an unknown --model: the file is not at fault
            log.error("%s: %s", path.name, exc)
            return None
        if rec.status is BatchStatus.FAILED:
            report = self.folder / FAILED / f"{path.stem}.errors.json"
            body = {"batch_id": rec.id, "file": path.name, "errors": errors_object(rec.errors)}
            service.write_atomic(report, orjson.dumps(body, option=orjson.OPT_INDENT_2) + b"\n")
            _move(path, self.folder / FAILED)
            log.warning("%s: failed validation (%d errors); see %s", path.name,
                        len(rec.errors), report)  # fmt: skip
        else:
            _move(path, self.folder / DONE)
            log.info("%s: batch %s, %d requests", path.name, rec.id, rec.request_counts.total)
        return rec


def _ends_in_newline(path: Path, size: int) -> bool:
    if size == 0:
        return False
    try:
        with path.open("rb") as f:
            f.seek(size - 1)
            return f.read(1) == b"\n"
    except OSError:
        return False


def _move(path: Path, folder: Path) -> Path:
    """Move `path` into `folder`, never over an earlier file of the same name."""
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / path.name
    n = 1
    while dest.exists():
        dest = folder / f"{path.stem}.{n}{path.suffix}"
        n += 1
    os.replace(path, dest)
    return dest
