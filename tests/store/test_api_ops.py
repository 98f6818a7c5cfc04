"""Store operations of the HTTP API: file pages, file deletion, starting a validated batch."""

from __future__ import annotations

from dataclasses import replace

from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.records import FileRecord
from batchmlx.store import Store

from .conftest import add_batch, batch, new_requests


def _file(i: int, created: int, purpose: str = "batch") -> FileRecord:
    return FileRecord(f"file-{i}", f"{i}.jsonl", purpose, 10, created, f"/tmp/f{i}")


def test_file_pages_follow_the_cursor_both_ways(with_store):
    async def scenario(store: Store) -> None:
        files = [_file(0, 100), _file(1, 100), _file(2, 101), _file(3, 102, "batch_output")]
        for f in files:
            await store.add_file(f)
        ids = lambda recs: [r.id for r in recs]  # noqa: E731
        assert ids(await store.list_files_page()) == ["file-3", "file-2", "file-1", "file-0"]
        assert ids(await store.list_files_page(order="asc", limit=2)) == ["file-0", "file-1"]
        assert ids(await store.list_files_page(order="asc", after="file-1")) == [
            "file-2", "file-3"]  # fmt: skip
        assert ids(await store.list_files_page(after="file-2", limit=1)) == ["file-1"]
        assert ids(await store.list_files_page(purpose="batch_output")) == ["file-3"]
        assert await store.list_files_page(after="file-nope") == []
        assert await store.delete_file("file-1") == files[1]
        assert await store.delete_file("file-1") is None
        assert await store.get_file("file-1") is None

    with_store(scenario)


def test_start_validated_batch_once(with_store):
    async def scenario(store: Store) -> None:
        validating = replace(batch("b1", status=BatchStatus.VALIDATING), model=None)
        await add_batch(store, validating, [])
        reqs = new_requests(3)
        assert await store.start_validated_batch("b1", reqs, 1005, model="tiny")
        rec = await store.get_batch("b1")
        assert rec.status is BatchStatus.IN_PROGRESS
        assert (rec.in_progress_at, rec.model) == (1005, "tiny")
        assert rec.request_counts.total == 3
        # a second validator lost the race: nothing changes, no duplicate requests
        assert not await store.start_validated_batch("b1", reqs, 1006, model="tiny")
        assert (await store.get_batch("b1")).request_counts.total == 3

    with_store(scenario)
