"""The engine off the event loop (issue 21): a long engine step stalls neither the loop (HTTP
handlers, timers) nor the worker's leases, a stop during it loses nothing, and tokens cross back
to the loop safely. Real Worker, real SQLite store, a fake engine whose step can be held."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from batchmlx import batches
from batchmlx.config import Settings
from batchmlx.core.engine_api import EngineSettings
from batchmlx.store import Store
from batchmlx.worker import Worker, WorkerOptions
from batchmlx.worker.build import ServingModel
from batchmlx.worker.engine_thread import THREAD_NAME
from batchmlx.worker.online import DoneEvent, TokenEvent
from batchmlx.worker.translate import Translator

from .fake_engine import FakeEngine, FakeTokenizer, expected_tokens
from .test_worker_fake_engine import _file

TOK = FakeTokenizer()
HOLD_S = 2.0  # a long step: the base worker's loop stood still this long


class SlowEngine(FakeEngine):
    """Steps number `slow` (1-based) hold for HOLD_S (or until `release`); records threads."""

    def __init__(self, settings: EngineSettings, slow: frozenset[int]) -> None:
        super().__init__(settings)
        self.slow = slow
        self.in_step = threading.Event()
        self.release = threading.Event()
        self.threads: set[str] = set()

    def add(self, req):
        self.threads.add(threading.current_thread().name)
        super().add(req)

    def step(self):
        self.threads.add(threading.current_thread().name)
        if self.steps + 1 in self.slow:
            self.in_step.set()
            self.release.wait(HOLD_S)
        return super().step()


def _rig(tmp_path: Path, slow: frozenset[int], lease_s: float = 60.0, **opts):
    settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache", poll_s=0.01,
                        lease_s=lease_s)  # fmt: skip
    engine_settings = EngineSettings(max_batch_size=1)
    engines: list[SlowEngine] = []

    def build(name: str) -> ServingModel:
        engine = SlowEngine(engine_settings, slow)
        engines.append(engine)
        translator = Translator(FakeTokenizer(), "fake-model", engine.max_context_tokens, [])
        return ServingModel(name, engine, translator)

    async def open_(n: int, max_tokens: int = 2):
        store = await Store.open(settings.db_path)
        rec = await batches.intake.submit(store, settings, _file(n, max_tokens),
                                          filename="in.jsonl", now=time.time())  # fmt: skip
        worker = Worker(store, settings, WorkerOptions(engine=engine_settings, **opts),
                        clock=time.time, engine_factory=build)  # fmt: skip
        return store, rec, worker

    return open_, engines


async def _max_gap_while(task: asyncio.Task, every: float = 0.01) -> float:
    """The longest the loop went without running this coroutine, while `task` runs."""
    gap, last = 0.0, time.monotonic()
    while not task.done():
        await asyncio.sleep(every)
        now = time.monotonic()
        gap, last = max(gap, now - last), now
    return gap


def test_a_long_step_does_not_stall_the_event_loop(tmp_path: Path) -> None:
    open_, engines = _rig(tmp_path, slow=frozenset({2}), until_idle=True)

    async def main():
        store, rec, worker = await open_(2)
        run = asyncio.create_task(worker.run())
        gap = await _max_gap_while(run)
        await run
        done = await store.get_batch(rec.id)
        await store.close()
        return gap, done

    gap, done = asyncio.run(main())
    assert done.request_counts.completed == 2
    assert gap < HOLD_S / 2, f"the loop stood still {gap:.2f}s during a {HOLD_S}s step"
    (engine,) = engines
    assert engine.threads == {THREAD_NAME}  # add and step: only ever on the engine thread


def test_leases_are_renewed_while_a_step_runs(tmp_path: Path) -> None:
    # a lease of 0.6 s: renewed every 0.1-0.3 s, so a 2 s step outlives three leases
    open_, engines = _rig(tmp_path, slow=frozenset({2}), lease_s=0.6, until_idle=True)
    beats: list[float] = []

    async def main():
        store, rec, worker = await open_(2)
        heartbeat = store.heartbeat

        async def counted(*a, **kw):
            if engines and engines[0].in_step.is_set() and not engines[0].release.is_set():
                beats.append(time.monotonic())
            return await heartbeat(*a, **kw)

        store.heartbeat = counted  # type: ignore[method-assign]
        await worker.run()
        done = await store.get_batch(rec.id)
        await store.close()
        return done

    done = asyncio.run(main())
    assert done.request_counts.completed == 2
    assert len(beats) >= 3, f"{len(beats)} heartbeats during a {HOLD_S}s step with a 0.6s lease"


def test_a_stop_during_a_long_step_keeps_its_results_and_gives_back_the_rest(
    tmp_path: Path,
) -> None:
    # one running at a time, 2 tokens each: step 2 finishes r0; stop while it runs
    open_, engines = _rig(tmp_path, slow=frozenset({2}))

    async def main():
        store, rec, worker = await open_(4)
        run = asyncio.create_task(worker.run())
        while not engines or not engines[0].in_step.is_set():
            await asyncio.sleep(0.01)
        t0 = time.monotonic()
        worker.stop_requested = True  # as the SIGTERM handler does, on the loop
        engines[0].release.set()  # the step ends
        await asyncio.wait_for(run, 10)
        took = time.monotonic() - t0
        counts = (await store.get_batch(rec.id)).request_counts
        statuses = await store.status_counts()
        await store.close()
        return took, counts, statuses

    took, counts, (_, requests) = asyncio.run(main())
    assert took < 5
    assert counts.completed == 1  # r0, finished in the step that ran at the stop
    by_status = {s.value: n for s, n in requests.items() if n}
    assert by_status == {"succeeded": 1, "queued": 3}, by_status  # no row left `running`
    assert engines[0].steps == 2  # no step after the stop


def test_streamed_tokens_cross_to_the_loop_in_order(tmp_path: Path) -> None:
    async def main():
        settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache", poll_s=0.01)
        store = await Store.open(settings.db_path)

        def build(name: str) -> ServingModel:
            engine = SlowEngine(EngineSettings(max_batch_size=4), frozenset())
            return ServingModel(name, engine, Translator(FakeTokenizer(), "fake", 256, []))

        worker = Worker(store, settings, WorkerOptions(), engine_factory=build)
        run = asyncio.create_task(worker.run())
        ticket = worker.online.submit(
            "/v1/completions", {"model": "default", "prompt": "ab", "max_tokens": 5}
        )
        events = []
        while not isinstance(ev := await asyncio.wait_for(ticket.events.get(), 10), DoneEvent):
            events.append(ev)
        worker.stop_requested = True
        await asyncio.wait_for(run, 10)
        await store.close()
        return events, ev

    events, done = asyncio.run(main())
    assert done.status_code == 200
    want = expected_tokens(TOK.encode("ab"), 5)
    assert [e.token_id for e in events if isinstance(e, TokenEvent)] == want
    assert done.body["choices"][0]["text"] == TOK.decode(want)
