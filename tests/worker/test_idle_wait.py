"""The idle wait on PostgreSQL (issue 21): woken by a stop, inside the retry, and blind to leases
of batches the worker does not serve. Real Worker, real PostgreSQL, a fake engine."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from sqlalchemy.exc import OperationalError

from batchmlx import batches
from batchmlx.config import Settings
from batchmlx.core.engine_api import ENGINE_DEFAULTS
from batchmlx.store import Store
from batchmlx.worker import Worker, WorkerOptions

from .fake_engine import fake_factory
from .test_worker_fake_engine import _file

# the idle wait's longest sleep on PostgreSQL: lease_s / 3 = 20 s
SETTINGS = dict(poll_s=0.5, lease_s=60.0)


async def _worker(tmp_path: Path, pg_url: str, **opts) -> tuple[Store, Worker]:
    settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache",
                        database=pg_url, **SETTINGS)  # fmt: skip
    store = await Store.from_settings(settings)
    assert store.listens  # PostgreSQL: the idle wait is a LISTEN, not a poll
    factory = fake_factory([], ENGINE_DEFAULTS)
    worker = Worker(store, settings, WorkerOptions(**opts), engine_factory=factory)
    return store, worker


async def _until_registered(store: Store, worker: Worker) -> None:
    for _ in range(500):
        if worker.worker_id in await store.live_workers(time.time() + 60, 3600):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the worker never sent its first heartbeat")


def test_a_stop_wakes_an_idle_worker_at_once(tmp_path: Path, pg_url: str) -> None:
    async def main() -> float:
        store, worker = await _worker(tmp_path, pg_url)
        run = asyncio.create_task(worker.run())
        await _until_registered(store, worker)
        await asyncio.sleep(0.3)  # into the idle wait
        t0 = time.monotonic()
        worker.stop_requested = True
        await asyncio.wait_for(run, 15)
        took = time.monotonic() - t0
        await store.close()
        return took

    took = asyncio.run(main())
    assert took < 1.0, f"an idle worker took {took:.1f}s to stop"


def test_a_database_error_in_the_idle_wait_does_not_end_the_worker(
    tmp_path: Path, pg_url: str
) -> None:
    calls: list[float] = []

    async def main() -> None:
        store, worker = await _worker(tmp_path, pg_url)
        real = store.next_lease_end

        async def failing_once(*a, **kw):
            calls.append(time.monotonic())
            if len(calls) == 1:
                raise OperationalError("SELECT", {}, Exception("connection was closed (injected)"))
            return await real(*a, **kw)

        store.next_lease_end = failing_once  # type: ignore[method-assign]
        run = asyncio.create_task(worker.run())
        while len(calls) < 2 and not run.done():
            await asyncio.sleep(0.05)
        assert not run.done(), run.exception()  # it retried instead of ending
        worker.stop_requested = True
        await asyncio.wait_for(run, 15)
        await store.close()

    asyncio.run(main())
    assert len(calls) >= 2


def test_idle_polling_ignores_leases_of_models_it_does_not_serve(
    tmp_path: Path, pg_url: str
) -> None:
    # a batch of model A (a local folder) whose lease ran out (its worker died); this worker
    # serves "other"
    model_a = tmp_path / "acme-a"
    model_a.mkdir()
    (model_a / "config.json").write_text("{}")

    async def main() -> int:
        store, worker = await _worker(tmp_path, pg_url, only_models=("other",))
        settings = worker.settings
        rec = await batches.intake.submit(store, settings, _file(2), filename="in.jsonl",
                                          now=time.time(), model=str(model_a))  # fmt: skip
        now = time.time()
        assert await store.claim("w-dead", 2, now - 100, 1.0, batch_id=rec.id)  # expired
        rounds = 0
        active = store.active_batches

        async def counted():
            nonlocal rounds
            rounds += 1
            return await active()

        store.active_batches = counted  # type: ignore[method-assign]
        run = asyncio.create_task(worker.run())
        await asyncio.sleep(3.0)
        worker.stop_requested = True
        await asyncio.wait_for(run, 15)
        claimed = (await store.get_batch(rec.id)).request_counts
        await store.close()
        assert claimed.completed == 0  # left to a worker of model A
        return rounds

    rounds = asyncio.run(main())
    # the base worker woke every 50 ms for the ended lease (~106 transactions/s); now at
    # most every poll_s (the claim rounds each read the active batches once or twice)
    assert rounds <= 20, f"{rounds} claim rounds in 3 s"
