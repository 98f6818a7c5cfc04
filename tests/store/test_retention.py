"""Retention on a real store (SQLite and PostgreSQL): a finished batch's prompts, responses and
errors leave the database with the files they came from or went to, its counts and usage stay;
`purge_finished` (`batchmlx purge`, $BATCHMLX_RETENTION_DAYS) removes whole batches that finished
long enough ago, and the worker's housekeeping applies the setting."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
from sqlalchemy import func, select

from batchmlx.batches.files import delete_expired_files, delete_file, store_file
from batchmlx.batches.finalize import finalize
from batchmlx.batches.intake import submit
from batchmlx.config import Settings
from batchmlx.store.models import FILES, REQUESTS
from tests.store.conftest import failed, ok

HOUR, DAY = 3600, 86_400
SECRET = "the prompt nobody should keep"


def _settings(tmp_path: Path, **kw) -> Settings:
    return Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache", **kw)


def _line(custom_id: str) -> bytes:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"{SECRET} {custom_id}"}]}
    return orjson.dumps({"custom_id": custom_id, "method": "POST",
                         "url": "/v1/chat/completions", "body": body}) + b"\n"  # fmt: skip


async def _finished(store, settings, now: float, *, expires: int | None = None):
    """A batch of two lines, one answered and one failed, finalized at `now` + 3."""
    rec = await submit(store, settings, _line("a") + _line("b"), filename="in.jsonl", now=now,
                       model="default", output_expires_after=expires)  # fmt: skip
    claimed = await store.claim("w", 10, now + 1, 60, batch_id=rec.id)
    by_id = {c.custom_id: c.id for c in claimed}
    await store.complete("w", [(by_id["a"], ok(prompt=7, completion=3)),
                               (by_id["b"], failed())], now + 2)  # fmt: skip
    return await finalize(store, settings, rec.id, now=now + 3)


async def _contents(store, batch_id: str) -> dict[str, tuple]:
    """custom_id -> (body, response_body, error) as stored."""
    query = select(REQUESTS.c.custom_id, REQUESTS.c.body, REQUESTS.c.response_body,
                   REQUESTS.c.error).where(REQUESTS.c.batch_id == batch_id)  # fmt: skip
    async with store._reader.connect() as conn:
        return {r[0]: tuple(r[1:]) for r in await conn.execute(query)}


def _counts(rec) -> tuple:
    c, u = rec.request_counts, rec.usage
    return (c.total, c.completed, c.failed, u.input_tokens, u.output_tokens)


def test_each_deleted_file_takes_its_contents_and_the_counts_stay(with_store, tmp_path):
    settings = _settings(tmp_path)

    async def go(store):
        rec = await _finished(store, settings, 1000)
        before = _counts(await store.get_batch(rec.id))
        assert before == (2, 1, 1, 7, 3)
        rows = await _contents(store, rec.id)
        assert SECRET in rows["a"][0] and rows["a"][1] is not None and rows["b"][1] is not None
        assert await delete_file(store, rec.output_file_id)  # the answers go
        rows = await _contents(store, rec.id)
        assert rows["a"][1] is None and rows["b"][1] is not None and SECRET in rows["a"][0]
        assert await delete_file(store, rec.error_file_id)  # the errors go
        rows = await _contents(store, rec.id)
        assert rows["b"][1:] == (None, None) and SECRET in rows["b"][0]
        assert await delete_file(store, rec.input_file_id)  # the prompts go
        rows = await _contents(store, rec.id)
        assert all(SECRET not in body for body, _, _ in rows.values())
        after = await store.get_batch(rec.id)
        assert _counts(after) == before and after.status.value == "completed"

    with_store(go)


def test_expired_output_files_take_the_responses_with_them(with_store, tmp_path):
    settings = _settings(tmp_path)

    async def go(store):
        rec = await _finished(store, settings, 1000, expires=HOUR)
        gone = await delete_expired_files(store, now=1003 + HOUR)
        assert sorted(gone) == sorted([rec.output_file_id, rec.error_file_id])
        assert await store.get_file(rec.output_file_id) is None
        rows = await _contents(store, rec.id)
        assert [r[1:] for r in rows.values()] == [(None, None), (None, None)]
        assert _counts(await store.get_batch(rec.id)) == (2, 1, 1, 7, 3)

    with_store(go)


def test_an_unfinished_batch_keeps_its_prompts_when_its_input_goes(with_store, tmp_path):
    from batchmlx.batches.retention import forget_orphaned

    settings = _settings(tmp_path)

    async def go(store):
        rec = await submit(store, settings, _line("a"), filename="in.jsonl", now=1000,
                           model="default")  # fmt: skip
        assert await delete_file(store, rec.input_file_id)
        assert await forget_orphaned(store) == 0
        (claimed,) = await store.claim("w", 10, 1001, 60, batch_id=rec.id)
        assert SECRET in claimed.body["messages"][0]["content"]  # still there to run
        await store.complete("w", [(claimed.id, ok())], 1002)
        await finalize(store, settings, rec.id, now=1003)
        assert await forget_orphaned(store) == 1  # finished: the sweep drops it
        assert all(SECRET not in r[0] for r in (await _contents(store, rec.id)).values())

    with_store(go)


async def _file_count(store) -> int:
    async with store._reader.connect() as conn:
        return (await conn.execute(select(func.count()).select_from(FILES))).scalar_one()


def test_purge_removes_batches_finished_before_the_cutoff(with_store, tmp_path):
    from batchmlx.batches.retention import finished_before, purge_finished

    settings = _settings(tmp_path)

    async def go(store):
        old = await _finished(store, settings, 1000)
        new = await _finished(store, settings, 1000 + 2 * DAY)
        running = await submit(store, settings, _line("x"), filename="r.jsonl", now=1000,
                               model="default")  # fmt: skip
        other = await store_file(store, settings, b"kept", filename="k", purpose="batch",
                                 now=1000)  # fmt: skip
        now = 1003 + 2 * DAY + HOUR
        assert [b.id for b in await finished_before(store, older_than_days=1, now=now)] == [old.id]
        (gone,) = await purge_finished(store, older_than_days=1, now=now)
        assert (gone.id, gone.status.value, gone.requests) == (old.id, "completed", 2)
        assert {f.id for f in gone.files} == {old.input_file_id, old.output_file_id,
                                              old.error_file_id}  # fmt: skip
        assert await store.get_batch(old.id) is None
        assert await _contents(store, old.id) == {}
        for f in gone.files:
            assert await store.get_file(f.id) is None
            assert not await _readable(store, f)
        # the newer one, the unfinished one and a file of no batch are untouched
        assert await store.get_batch(new.id) is not None
        assert (await store.get_batch(running.id)).status.value == "in_progress"
        assert await store.get_file(other.id) is not None
        assert await purge_finished(store, older_than_days=1, now=now) == []
        everything = await purge_finished(store, older_than_days=0, now=now)
        assert [p.id for p in everything] == [new.id]
        assert await _file_count(store) == 2  # the unfinished batch's input, the other file

    with_store(go)


async def _readable(store, rec) -> bool:
    try:
        return bool(await store.read_file_bytes(rec))
    except FileNotFoundError:
        return False


def test_the_worker_housekeeping_applies_the_retention_setting(with_store, tmp_path):
    from batchmlx.worker import WorkerOptions
    from batchmlx.worker.loop import Worker

    settings = dataclasses.replace(_settings(tmp_path), retention_days=1.0)
    now = [1000.0]

    async def go(store):
        rec = await _finished(store, settings, now[0])
        worker = Worker(store, settings, WorkerOptions(), clock=lambda: now[0])
        await worker.tick()
        assert await store.get_batch(rec.id) is not None  # finished a moment ago
        now[0] += DAY + HOUR
        await worker.tick()
        assert await store.get_batch(rec.id) is None
        assert await store.get_file(rec.output_file_id) is None

    with_store(go)
