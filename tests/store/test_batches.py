"""Files and batches: create, read, list, status moves, stats."""

from __future__ import annotations

from dataclasses import replace

import pytest

from batchmlx.core.lifecycle import BatchStatus, TransitionError
from batchmlx.core.records import (
    BatchErrorRecord,
    BatchUsage,
    CacheOutcomes,
    FileRecord,
    RequestCounts,
)
from batchmlx.store import BatchRef, Store

from .conftest import add_batch, batch, failed, new_requests, ok


def test_files_round_trip(with_store):
    async def scenario(store: Store) -> None:
        a = FileRecord("file-a", "in.jsonl", "batch", 120, 1000, "/tmp/files/file-a")
        b = FileRecord("file-b", "out.jsonl", "batch_output", 80, 1001, "/tmp/files/file-b")
        await store.add_file(a)
        await store.add_file(b)
        assert await store.get_file("file-a") == a
        assert await store.get_file("file-zzz") is None
        assert await store.list_files_page() == [b, a]
        assert await store.list_files_page(purpose="batch") == [a]

    with_store(scenario)


def test_create_and_get_batch_with_live_counts_and_usage(with_store):
    async def scenario(store: Store) -> None:
        rec = batch("batch_a", metadata={"team": "x"}, expires_at=1000 + 86400)
        await add_batch(store, rec, new_requests(4), content_hash="h1", source="cli")
        got = await store.get_batch("batch_a")
        assert got == replace(rec, request_counts=RequestCounts(total=4), in_progress_at=1000)
        assert got.metadata == {"team": "x"} and got.stats == {}

        claimed = await store.claim("w1", 3, now=2000.0, lease_s=60.0)
        results = [
            (claimed[0].id, ok(prompt=10, cached=4, completion=5)),
            (claimed[1].id, ok(prompt=20, cached=0, completion=7)),
            (claimed[2].id, failed()),
        ]
        assert await store.complete("w1", results, now=2001.0) == 3
        got = await store.get_batch("batch_a")
        assert got.request_counts == RequestCounts(total=4, completed=2, failed=1)
        assert got.usage == BatchUsage(input_tokens=30, cached_tokens=4, output_tokens=12)
        assert (await store.get_batch("batch_a")).request_counts == got.request_counts
        assert await store.get_batch("batch_nope") is None

    with_store(scenario)


def test_failed_batch_stored_with_errors_and_no_requests(with_store):
    errors = (
        BatchErrorRecord("invalid_json_line", "line 2 is not JSON", line=2),
        BatchErrorRecord("duplicate_custom_id", "custom_id a repeats", line=3, param="custom_id"),
    )

    async def scenario(store: Store) -> None:
        rec = batch("batch_f", status=BatchStatus.FAILED, errors=errors, failed_at=1000)
        await add_batch(store, rec, [])
        got = await store.get_batch("batch_f")
        assert got.status is BatchStatus.FAILED
        assert got.errors == errors
        assert got.failed_at == 1000
        assert got.request_counts == RequestCounts(0, 0, 0)
        assert await store.claim("w1", 10, now=1.0, lease_s=1.0) == []

    with_store(scenario)


def test_list_batches_newest_first_with_after_pagination(with_store):
    async def scenario(store: Store) -> None:
        # two share a created_at: insertion order breaks the tie
        for i, created in enumerate([100, 200, 200, 300, 400]):
            await add_batch(store, batch(f"batch_{i}", created_at=created), new_requests(i))
        page1 = await store.list_batches(limit=2)
        assert [b.id for b in page1] == ["batch_4", "batch_3"]
        page2 = await store.list_batches(limit=2, after=page1[-1].id)
        assert [b.id for b in page2] == ["batch_2", "batch_1"]
        page3 = await store.list_batches(limit=2, after=page2[-1].id)
        assert [b.id for b in page3] == ["batch_0"]
        assert await store.list_batches(limit=2, after="batch_0") == []
        assert [b.request_counts.total for b in page1 + page2 + page3] == [4, 3, 2, 1, 0]

    with_store(scenario)


def test_find_batch_by_hash(with_store):
    async def scenario(store: Store) -> None:
        await add_batch(store, batch("batch_a", created_at=1), new_requests(1), content_hash="h")
        await add_batch(store, batch("batch_b", created_at=2), new_requests(1), content_hash="h")
        await add_batch(store, batch("batch_c", created_at=3), new_requests(1))
        found = await store.find_batch_by_hash("h")
        assert found is not None and found.id == "batch_b"
        assert await store.find_batch_by_hash("other") is None
        # only batches in the statuses asked for: a newer failed one is passed over
        bad = batch("batch_d", created_at=4, status=BatchStatus.FAILED, failed_at=4)
        await add_batch(store, bad, [], content_hash="h")
        assert (await store.find_batch_by_hash("h")).id == "batch_d"
        found = await store.find_batch_by_hash("h", [BatchStatus.IN_PROGRESS])
        assert found is not None and found.id == "batch_b"
        assert await store.find_batch_by_hash("h", [BatchStatus.COMPLETED]) is None

    with_store(scenario)


def test_find_batch_by_source(with_store):
    async def scenario(store: Store) -> None:
        src = "inbox:/x/a.jsonl#drop=1-2-3"
        await add_batch(store, batch("batch_a", created_at=1), new_requests(1), source=src)
        await add_batch(store, batch("batch_b", created_at=2), new_requests(1), source="cli")
        assert (await store.find_batch_by_source(src)).id == "batch_a"
        assert await store.find_batch_by_source("inbox:/x/a.jsonl#drop=1-2-4") is None

    with_store(scenario)


def test_set_batch_status_checks_the_lifecycle_and_stamps_times(with_store):
    async def scenario(store: Store) -> None:
        await add_batch(store, batch("batch_a", status=BatchStatus.VALIDATING))
        rec = await store.set_batch_status("batch_a", BatchStatus.IN_PROGRESS, now=1010.7)
        assert rec.status is BatchStatus.IN_PROGRESS and rec.in_progress_at == 1010
        rec = await store.set_batch_status("batch_a", BatchStatus.FINALIZING, now=1020.0)
        assert rec.finalizing_at == 1020
        rec = await store.set_batch_status(
            "batch_a", BatchStatus.COMPLETED, now=1030.0, output_file_id="file-out"
        )
        assert rec.completed_at == 1030 and rec.output_file_id == "file-out"
        assert rec.in_progress_at == 1010 and rec.request_counts.total == 0
        with pytest.raises(TransitionError):
            await store.set_batch_status("batch_a", BatchStatus.CANCELLING, now=1040.0)
        with pytest.raises(KeyError):
            await store.set_batch_status("batch_nope", BatchStatus.IN_PROGRESS, now=1.0)
        with pytest.raises(TypeError):
            await store.set_batch_status("batch_a", BatchStatus.EXPIRED, now=1.0, status="x")
        assert (await store.get_batch("batch_a")).status is BatchStatus.COMPLETED

    with_store(scenario)


def test_set_batch_status_can_record_errors(with_store):
    async def scenario(store: Store) -> None:
        await add_batch(store, batch("batch_a", status=BatchStatus.VALIDATING), [])
        err = BatchErrorRecord("empty_file", "no lines")
        rec = await store.set_batch_status("batch_a", BatchStatus.FAILED, now=5.0, errors=[err])
        assert rec.errors == (err,) and rec.failed_at == 5

    with_store(scenario)


def test_update_batch_stats_merges(with_store):
    async def scenario(store: Store) -> None:
        await add_batch(store, batch("batch_a", stats={"a": 1}), [])
        await store.update_batch_stats("batch_a", {"prefix_hits": 3})
        await store.update_batch_stats("batch_a", {"prefix_hits": 5, "blocks": {"n": 2}})
        rec = await store.get_batch("batch_a")
        assert rec.stats == {"a": 1, "prefix_hits": 5, "blocks": {"n": 2}}
        with pytest.raises(KeyError):
            await store.update_batch_stats("batch_nope", {})

    with_store(scenario)


def test_batches_with_status_oldest_first(with_store):
    async def scenario(store: Store) -> None:
        await add_batch(store, batch("batch_c", created_at=3), [])
        await add_batch(store, batch("batch_a", created_at=1), [])
        await add_batch(store, batch("batch_v", created_at=2, status=BatchStatus.VALIDATING), [])
        await store.set_batch_status("batch_c", BatchStatus.CANCELLING, now=4.0)
        active = await store.active_batches()
        assert active == [
            BatchRef("batch_a", BatchStatus.IN_PROGRESS, "/v1/chat/completions", "tiny", 1)
        ]
        both = await store.batches_with_status(BatchStatus.CANCELLING, BatchStatus.VALIDATING)
        assert [b.id for b in both] == ["batch_v", "batch_c"]

    with_store(scenario)


def test_outcomes_and_the_span_of_work_are_live_from_the_requests(with_store):
    """A batch not yet finalized (running, or cancelling) has its prefix-cache outcomes and
    when work started and last ended: read from its requests, not from finalize's stats."""

    async def scenario(store: Store) -> None:
        await add_batch(store, batch("batch_o"), new_requests(4))
        queued = await store.get_batch("batch_o")
        assert queued.work_started_at is None and queued.work_ended_at is None
        assert queued.outcomes == CacheOutcomes() and queued.outcomes.hit_rate is None

        claimed = await store.claim("w1", 3, now=2000.5, lease_s=60.0)
        hit = replace(ok(prompt=10, cached=8), cache_outcome="PREFIX_HIT")
        await store.complete("w1", [(claimed[0].id, hit), (claimed[1].id, ok())], now=2003.25)
        await store.set_batch_status("batch_o", BatchStatus.CANCELLING, now=2004.0)
        got = await store.get_batch("batch_o")
        assert got.status is BatchStatus.CANCELLING and got.stats == {}
        assert got.outcomes == CacheOutcomes(hits=0, prefix_hits=1, misses=1)
        assert got.outcomes.hit_rate == 0.5
        assert got.usage.cached_tokens == 8
        assert (got.work_started_at, got.work_ended_at) == (2000.5, 2003.25)
        [listed] = await store.list_batches()
        assert listed.outcomes == got.outcomes and listed.work_started_at == 2000.5

    with_store(scenario)
