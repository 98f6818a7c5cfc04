"""Expiry with an injected clock: the pure rule, then the worker applying it to a real store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from batchmlx import batches
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus, RequestStatus, is_expired
from batchmlx.core.records import RequestResult
from batchmlx.formats.openai import BATCH_EXPIRED_MESSAGE
from batchmlx.store import Store
from batchmlx.worker import Worker, WorkerOptions
from tests.store_scenario import run_with_store

T0 = 1_000_000.0


def test_is_expired_rule() -> None:
    assert not is_expired(BatchStatus.IN_PROGRESS, 100, 99.9)
    assert is_expired(BatchStatus.IN_PROGRESS, 100, 100)
    assert not is_expired(BatchStatus.IN_PROGRESS, None, 1e12)
    for st in (BatchStatus.FINALIZING, BatchStatus.COMPLETED, BatchStatus.CANCELLING,
               BatchStatus.CANCELLED, BatchStatus.FAILED, BatchStatus.EXPIRED):  # fmt: skip
        assert not is_expired(st, 100, 200)


def _file(n: int) -> bytes:
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "default", "messages": [{"role": "user", "content": "hi"}]}}
        for i in range(n)
    ]  # fmt: skip
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def _ok() -> RequestResult:
    return RequestResult(RequestStatus.SUCCEEDED, 200, {"object": "chat.completion"})


def _lines(settings: Settings, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in (settings.files_dir / file_id).read_text().splitlines()]


def test_worker_expires_a_batch_past_its_window(tmp_path: Path) -> None:
    async def scenario(store: Store, settings: Settings) -> None:
        rec = await batches.intake.submit(store, settings, _file(3), filename="a.jsonl", now=T0,
                                   completion_window="2h")  # fmt: skip
        assert rec.expires_at == T0 + 7200
        # another worker ran r0 to the end and holds r1
        claimed = await store.claim("w-other", 2, T0 + 1, 60.0)
        await store.complete("w-other", [(claimed[0].id, _ok())], T0 + 2)

        now = [T0 + 7199.0]
        worker = Worker(store, settings, WorkerOptions(until_idle=True), clock=lambda: now[0])
        assert await worker.housekeeping.expire_batches() is False  # one second left
        assert (await store.get_batch(rec.id)).status is BatchStatus.IN_PROGRESS

        now[0] = T0 + 7200.0
        await worker.tick()
        done = await store.get_batch(rec.id)
        assert done.status is BatchStatus.EXPIRED and done.expired_at == int(T0 + 7200)
        assert [x["custom_id"] for x in _lines(settings, done.output_file_id)] == ["r0"]
        errors = _lines(settings, done.error_file_id)
        assert [x["custom_id"] for x in errors] == ["r1", "r2"]
        for x in errors:
            assert x["response"] is None
            assert x["error"] == {"code": "batch_expired", "message": BATCH_EXPIRED_MESSAGE}
        # the late write of the worker that held r1 changes nothing (fenced)
        assert await store.complete("w-other", [(claimed[1].id, _ok())], T0 + 7300) == 0
        # redoing it is harmless
        again = await batches.lifecycle.expire(store, settings, rec.id, now=T0 + 9000)
        assert again.status is BatchStatus.EXPIRED and again.error_file_id == done.error_file_id

    run_with_store(tmp_path, scenario)


def test_everything_finished_in_time_completes(tmp_path: Path) -> None:
    async def scenario(store: Store, settings: Settings) -> None:
        rec = await batches.intake.submit(store, settings, _file(2), filename="a.jsonl", now=T0,
                                   completion_window="1m")  # fmt: skip
        claimed = await store.claim("w", 2, T0, 60.0)
        await store.complete("w", [(c.id, _ok()) for c in claimed], T0 + 30)
        out = await batches.lifecycle.expire(store, settings, rec.id, now=T0 + 61)
        assert out.status is BatchStatus.COMPLETED

    run_with_store(tmp_path, scenario)


def test_expire_resumes_after_a_crash_between_results_and_files(tmp_path: Path) -> None:
    async def scenario(store: Store, settings: Settings) -> None:
        rec = await batches.intake.submit(store, settings, _file(2), filename="a.jsonl", now=T0,
                                   completion_window="1h")  # fmt: skip
        # the crash: unfinished requests got their batch_expired result, no file was written
        await store.finish_unfinished(rec.id, batches.lifecycle.EXPIRED_RESULT, T0 + 3600)
        # whoever finalizes next (a worker's finalize pass) still ends it as expired
        assert await store.batches_to_finalize() == [rec.id]
        out = await batches.finalize.finalize(store, settings, rec.id, now=T0 + 3700)
        assert out.status is BatchStatus.EXPIRED
        assert len(_lines(settings, out.error_file_id)) == 2

    run_with_store(tmp_path, scenario)


def test_window_option_and_cancel_of_a_finished_batch(tmp_path: Path) -> None:
    async def scenario(store: Store, settings: Settings) -> None:
        rec = await batches.intake.submit(store, settings, _file(1), filename="a.jsonl", now=T0,
                                   completion_window="3d")  # fmt: skip
        assert rec.completion_window == "3d" and rec.expires_at == T0 + 3 * 86400
        with pytest.raises(batches.BatchError, match="invalid completion window"):
            batches.windows.parse_window("soon")
        await batches.lifecycle.expire(store, settings, rec.id, now=T0 + 4 * 86400)
        with pytest.raises(batches.BatchError, match="Cannot cancel a batch with status 'expired'"):
            await batches.lifecycle.cancel(store, rec.id, now=T0 + 5 * 86400)

    run_with_store(tmp_path, scenario)
