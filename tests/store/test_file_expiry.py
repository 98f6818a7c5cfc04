"""Expiring files: `expires_after` on a file, `output_expires_after` on a batch, and the worker's
housekeeping deleting expired files (record and bytes, through the store's blob seam, so on disk
or in the database) on a real store."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from batchmlx.batches.errors import BatchError
from batchmlx.batches.files import delete_expired_files, file_content, store_file
from batchmlx.batches.finalize import finalize
from batchmlx.batches.intake import submit
from batchmlx.config import Settings
from batchmlx.core.lifecycle import RequestStatus
from batchmlx.core.records import RequestResult
from batchmlx.formats.expiry import ExpiresAfterError, parse_expires_after

HOUR = 3600


async def _has_bytes(store, rec) -> bool:
    """Whether a file's bytes are still stored, wherever the store keeps them."""
    try:
        return bool(await store.read_file_bytes(rec))
    except FileNotFoundError:
        return False


def _settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache")


def test_expired_files_are_deleted_with_their_bytes(with_store, tmp_path):
    settings = _settings(tmp_path)

    async def go(store):
        keep = await store_file(store, settings, b"keep", filename="k", purpose="batch",
                                now=1000)  # fmt: skip
        soon = await store_file(store, settings, b"soon", filename="s", purpose="batch",
                                now=1000, expires_after=HOUR)  # fmt: skip
        assert soon.expires_at == 1000 + HOUR and keep.expires_at is None
        assert (await store.get_file(soon.id)).expires_at == 1000 + HOUR
        assert await delete_expired_files(store, now=1000 + HOUR - 1) == []
        assert await delete_expired_files(store, now=1000 + HOUR) == [soon.id]
        assert await store.get_file(soon.id) is None and not await _has_bytes(store, soon)
        assert await store.get_file(keep.id) is not None and await _has_bytes(store, keep)

    with_store(go)


def test_output_files_of_a_batch_expire_after_output_expires_after(with_store, tmp_path):
    settings = _settings(tmp_path)
    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}}  # fmt: skip

    async def go(store):
        data = orjson.dumps(line) + b"\n"
        rec = await submit(store, settings, data, filename="f", now=1000,
                                   model="default", output_expires_after=2 * HOUR)  # fmt: skip
        assert (await store.get_batch(rec.id)).output_expires_after == 2 * HOUR
        (claimed,) = await store.claim("w", 10, 1001, 60, batch_id=rec.id)
        body = {"model": "SmolLM2", "choices": []}
        result = RequestResult(RequestStatus.SUCCEEDED, 200, body, prompt_tokens=3,
                               completion_tokens=2)  # fmt: skip
        await store.complete("w", [(claimed.id, result)], 1002)
        done = await finalize(store, settings, rec.id, now=1003)
        assert done.model == "SmolLM2"  # the model the bodies name, not the file's
        out = await store.get_file(done.output_file_id)
        assert out.expires_at == 1003 + 2 * HOUR
        assert await delete_expired_files(store, now=1003 + 2 * HOUR) == [out.id]
        with pytest.raises(BatchError):
            await file_content(store, out.id)

    with_store(go)


def test_expires_after_bounds():
    assert parse_expires_after({"anchor": "created_at", "seconds": HOUR}, "p") == HOUR
    assert parse_expires_after({"anchor": "created_at", "seconds": "7200"}, "p") == 7200
    assert parse_expires_after(None, "p") is None
    for value, param in (
        ({"anchor": "created_at", "seconds": 59}, "p.seconds"),
        ({"anchor": "created_at", "seconds": 2_592_001}, "p.seconds"),
        ({"anchor": "last_active_at", "seconds": HOUR}, "p.anchor"),
        ("1h", "p"),
    ):
        with pytest.raises(ExpiresAfterError) as exc:
            parse_expires_after(value, "p")
        assert exc.value.param == param


def test_the_worker_housekeeping_deletes_expired_files(with_store, tmp_path):
    from batchmlx.worker import WorkerOptions
    from batchmlx.worker.loop import Worker

    settings = _settings(tmp_path)
    now = [1000.0]

    async def go(store):
        f = await store_file(store, settings, b"x", filename="x", purpose="batch",
                             now=now[0], expires_after=HOUR)  # fmt: skip
        worker = Worker(store, settings, WorkerOptions(), clock=lambda: now[0])
        await worker.tick()
        assert await store.get_file(f.id) is not None
        now[0] += HOUR
        await worker.tick()
        assert await store.get_file(f.id) is None and not await _has_bytes(store, f)

    with_store(go)
