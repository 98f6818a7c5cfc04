"""Media read off the engine's thread (worker/media_pool.py): the real Worker on a real SQLite
store with a fake engine and a fake vision prompter, an image whose fetch stalls until the test
lets it go. Text requests run meanwhile; a cancel or a stop ends the fetch, leaks no thread, and
each row ends exactly once; the pool's bounds hold."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path
from typing import Any

from batchmlx import batches
from batchmlx.config import Settings
from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.records import ClaimedRequest
from batchmlx.formats.params import parse_request
from batchmlx.store import Store
from batchmlx.worker import Worker, WorkerOptions
from batchmlx.worker.build import ServingModel
from batchmlx.worker.fetch import Cancel, Cancelled
from batchmlx.worker.media import MediaReader
from batchmlx.worker.media_pool import THREAD_NAME, MediaPool
from batchmlx.worker.online import DoneEvent
from batchmlx.worker.translate import Translator

from .fake_engine import FakeEngine, FakeTokenizer

T0 = 1_000_000.0
TOK = FakeTokenizer()
IMAGE_URL = "https://images.test/cat.png"


class Gate:
    """A fetch that stalls until `release` (or its cancel) and says which it saw."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.cancelled = threading.Event()
        self.threads: set[str] = set()

    def __call__(self, url: str, limit: int, cancel: Cancel | None) -> tuple[bytes, str | None]:
        assert cancel is not None  # the pool always passes one
        self.threads.add(threading.current_thread().name)
        self.started.set()
        while not self.release.wait(0.01):
            if cancel.cancelled:
                self.cancelled.set()
                raise Cancelled("cancelled")
        return b"\x89PNG", "image/png"


class FakeVision:
    """A vision prompter for the fake engine: the text contents, the image as one token."""

    def prompt(self, messages, media):
        assert all(p.data is not None for p in media)  # read before the prompt is built
        text = "|".join(c["text"] if isinstance(c, dict) and "text" in c else str(c)
                        for m in messages for c in _contents(m))  # fmt: skip
        return [*TOK.encode(text or "x"), *([7] * len(media))], text, (), None


def _contents(m) -> list:
    content = m.get("content")
    return content if isinstance(content, list) else [content]


def vision_factory(engines: list[FakeEngine], settings: EngineSettings, fetch):
    def build(name: str) -> ServingModel:
        engine = FakeEngine(settings)
        engines.append(engine)
        tr = Translator(TOK, "fake-vlm", engine.max_context_tokens, [], vision=FakeVision(),
                        media=MediaReader(fetch=fetch))  # fmt: skip
        return ServingModel(name, engine, tr)

    return build


def chat(content: Any, max_tokens: int = 3) -> dict:
    return {"model": "default", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip


def image_content() -> list:
    return [{"type": "image_url", "image_url": {"url": IMAGE_URL}},
            {"type": "text", "text": "what is it"}]  # fmt: skip


def batch_file(texts: int) -> bytes:
    lines = [{"custom_id": "img", "method": "POST", "url": "/v1/chat/completions",
              "body": chat(image_content())}]  # fmt: skip
    lines += [{"custom_id": f"t{i}", "method": "POST", "url": "/v1/chat/completions",
               "body": chat(f"text {i}")} for i in range(texts)]  # fmt: skip
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def media_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD_NAME]


class Rig:
    def __init__(self, tmp_path: Path, **opts: Any) -> None:
        self.settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache", poll_s=0.01)
        self.engine_settings = EngineSettings(max_batch_size=4)
        self.engines: list[FakeEngine] = []
        self.gate = Gate()
        self.opts = opts

    async def open(self, data: bytes) -> None:
        self.store = await Store.open(self.settings.db_path)
        self.batch = await batches.intake.submit(
            self.store, self.settings, data, filename="in.jsonl", now=T0
        )
        opts = WorkerOptions(engine=self.engine_settings, **{"until_idle": True, **self.opts})
        self.worker = Worker(
            self.store, self.settings, opts, clock=lambda: T0 + 1,
            engine_factory=vision_factory(self.engines, self.engine_settings, self.gate),
        )  # fmt: skip

    async def completed(self) -> int:
        return (await self.store.get_batch(self.batch.id)).request_counts.completed

    async def wait_for(self, cond, timeout: float = 20.0) -> None:
        end = time.monotonic() + timeout
        while not await cond():
            assert time.monotonic() < end, "timed out"
            await asyncio.sleep(0.01)


def test_a_stalled_image_fetch_holds_up_no_text_request(tmp_path: Path) -> None:
    rig = Rig(tmp_path)

    async def main():
        await rig.open(batch_file(texts=8))
        run = asyncio.create_task(rig.worker.run())

        async def texts_done() -> bool:
            return await rig.completed() == 8

        await rig.wait_for(texts_done)  # every text line while the image line's fetch stalls
        assert rig.gate.started.is_set() and not run.done()
        assert rig.gate.threads == {THREAD_NAME}  # read on a fetch thread, not the engine's
        (engine,) = rig.engines
        assert all(not r.startswith("1:") for r in engine.admitted)  # img (row 1) not in yet
        rig.gate.release.set()
        await asyncio.wait_for(run, 20)
        rec = await rig.store.get_batch(rig.batch.id)
        await rig.store.close()
        return rec

    rec = asyncio.run(main())
    assert rec.status is BatchStatus.COMPLETED and rec.request_counts.completed == 9
    assert rec.request_counts.failed == 0
    assert media_threads() == []  # the pool's threads ended with the worker


def test_a_cancelled_batch_ends_its_fetch_and_its_row_once(tmp_path: Path) -> None:
    rig = Rig(tmp_path)

    async def main():
        await rig.open(batch_file(texts=2))
        run = asyncio.create_task(rig.worker.run())

        async def stalled() -> bool:
            return rig.gate.started.is_set() and await rig.completed() == 2

        await rig.wait_for(stalled)
        await batches.lifecycle.cancel(rig.store, rig.batch.id, now=T0 + 1)
        rig.worker._next_housekeeping = 0.0
        await asyncio.wait_for(run, 20)
        rec = await rig.store.get_batch(rig.batch.id)
        await rig.store.close()
        return rec

    rec = asyncio.run(main())
    assert rig.gate.cancelled.is_set()  # the fetch under way was ended, not waited for
    assert rec.status is BatchStatus.CANCELLED
    errors = [json.loads(x) for x in (rig.settings.files_dir / rec.error_file_id).read_text()
              .splitlines()]  # fmt: skip
    assert [e["custom_id"] for e in errors] == ["img"]  # one line for the image row
    assert errors[0]["error"]["code"] == "batch_cancelled"
    assert media_threads() == []


def test_a_stopping_worker_ends_the_fetch_and_gives_the_row_back(tmp_path: Path) -> None:
    rig = Rig(tmp_path, until_idle=False)

    async def main():
        await rig.open(batch_file(texts=1))
        run = asyncio.create_task(rig.worker.run())

        async def stalled() -> bool:
            return rig.gate.started.is_set() and await rig.completed() == 1

        await rig.wait_for(stalled)
        rig.worker.stop_requested = True
        await asyncio.wait_for(run, 10)
        again = await rig.store.claim("other", 10, T0 + 2, 60.0)
        rec = await rig.store.get_batch(rig.batch.id)
        await rig.store.close()
        return again, rec

    again, rec = asyncio.run(main())
    assert rig.gate.cancelled.is_set()
    assert [c.custom_id for c in again] == ["img"]  # back in the queue, no result written
    assert again[0].attempts == 1  # stopping is not failing
    assert rec.request_counts.completed == 1 and rec.request_counts.failed == 0
    assert media_threads() == []


def test_an_online_image_request_waits_for_its_fetch_and_a_gone_client_ends_it(tmp_path):
    rig = Rig(tmp_path, until_idle=False)

    async def main():
        await rig.open(b"")
        run = asyncio.create_task(rig.worker.run())
        image = rig.worker.online.submit("/v1/chat/completions", chat(image_content()))
        text = rig.worker.online.submit("/v1/chat/completions", chat("hello"))
        done = await asyncio.wait_for(_done(text), 10)  # answered while the image's fetch stalls
        assert done.status_code == 200 and rig.gate.started.is_set() and image.events.empty()
        rig.gate.release.set()
        assert (await asyncio.wait_for(_done(image), 10)).status_code == 200
        rig.gate.release.clear()
        gone = rig.worker.online.submit("/v1/chat/completions", chat(image_content()))
        while gone.id not in rig.worker.inflight.media:
            await asyncio.sleep(0.01)
        rig.worker.online.cancel(gone)  # the client went away
        assert await asyncio.to_thread(rig.gate.cancelled.wait, 5)  # before the stop
        rig.worker.stop_requested = True
        await asyncio.wait_for(run, 10)
        await rig.store.close()

    rig.gate.release.clear()
    asyncio.run(main())
    assert rig.gate.cancelled.is_set() and media_threads() == []


async def _done(ticket) -> DoneEvent:
    while True:
        event = await ticket.events.get()
        if isinstance(event, DoneEvent):
            return event


def _image_request(row: int) -> tuple[ClaimedRequest, Any]:
    """A claimed chat row with one https image part, and its parsed request."""
    body = chat(image_content())
    c = ClaimedRequest(row, "b", f"c{row}", row, "/v1/chat/completions", "m", body, 1)
    return c, parse_request(c.endpoint, body)


def test_the_pool_bounds_its_threads_and_its_waiting_requests():
    gate = Gate()
    reader = MediaReader(fetch=gate)
    pool = MediaPool(threads=2, max_waiting=3)

    for row in (1, 2, 3):
        assert pool.submit(*_image_request(row), reader)
    assert pool.full and len(pool) == 3
    assert pool.submit(*_image_request(4), reader)  # a batch row past the bound waits, held back
    assert len(pool) == 4 and 4 in pool
    assert not pool.submit(*_image_request(-1), reader)  # an online request gets its 503 at once
    gate.started.wait(5)
    time.sleep(0.1)
    assert len(media_threads()) == 2  # at most `threads` reads at a time
    gate.release.set()
    taken: list[int] = []
    end = time.monotonic() + 10
    while len(taken) < 4 and time.monotonic() < end:
        taken += [j.row for j in pool.take_done()]
        time.sleep(0.01)
    assert sorted(taken) == [1, 2, 3, 4] and len(pool) == 0
    pool.close()
    assert media_threads() == []


def test_a_row_held_back_starts_when_the_rows_ahead_of_it_are_cancelled():
    """Cancelling every read under way frees their slots to the rows held back at once: no
    read ends to make room (nothing would take them otherwise, and their batch would hang)."""
    gate = Gate()
    reader = MediaReader(fetch=gate)
    pool = MediaPool(threads=2, max_waiting=2)

    for row in (1, 2, 3):
        assert pool.submit(*_image_request(row), reader)
    assert pool.full and 3 in pool
    assert pool.cancel(1) and pool.cancel(2)
    gate.release.set()
    try:  # the worker takes reads only once one has ended: row 3's must end by itself
        end = time.monotonic() + 10
        while not pool.has_done and time.monotonic() < end:
            time.sleep(0.01)
        assert [j.row for j in pool.take_done()] == [3] and len(pool) == 0
    finally:
        pool.close()
    assert media_threads() == []


def test_a_worker_run_again_reads_images_again(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.gate.release.set()

    async def main():
        await rig.open(batch_file(texts=1))
        await rig.worker.run()
        more = await batches.intake.submit(
            rig.store, rig.settings, batch_file(texts=0), filename="more.jsonl", now=T0
        )
        await rig.worker.run()  # its media pool was closed by the first run's end
        recs = [await rig.store.get_batch(b) for b in (rig.batch.id, more.id)]
        await rig.store.close()
        return recs

    first, second = asyncio.run(main())
    assert first.request_counts.completed == 2 and second.request_counts.completed == 1
    assert media_threads() == []
