"""The real Worker on a real SQLite store with a fake engine: worker logic in milliseconds."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from batchmlx import batches
from batchmlx.config import Settings
from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.priority import engine_priority
from batchmlx.store import Store
from batchmlx.worker import Worker, WorkerOptions
from batchmlx.worker.online import DoneEvent

from .fake_engine import FakeEngine, FakeTokenizer, expected_tokens, fake_factory

T0 = 1_000_000.0
TOK = FakeTokenizer()


def _file(n: int, max_tokens: int = 3) -> bytes:
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": "default", "prompt": f"p{chr(97 + i)}", "max_tokens": max_tokens}}
        for i in range(n)
    ]  # fmt: skip
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def _text(i: int, max_tokens: int = 3) -> str:
    """What the fake engine answers request r{i} of `_file`."""
    return TOK.decode(expected_tokens(TOK.encode(f"p{chr(97 + i)}"), max_tokens))


def _lines(settings: Settings, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in (settings.files_dir / file_id).read_text().splitlines()]


def _outputs(settings: Settings, file_id: str | None) -> dict[str, str]:
    return {
        line["custom_id"]: line["response"]["body"]["choices"][0]["text"]
        for line in _lines(settings, file_id)
    }


class Rig:
    """A store in tmp_path, a submitted batch, and a Worker whose engines are fakes."""

    def __init__(self, tmp_path: Path, engine: EngineSettings, **worker_opts: Any) -> None:
        self.settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache", poll_s=0.01)
        self.engine_settings = engine
        self.worker_opts = worker_opts
        self.engines: list[FakeEngine] = []

    async def open(self, data: bytes, **fake: Any) -> None:
        self.store = await Store.open(self.settings.db_path)
        self.batch = await batches.intake.submit(
            self.store, self.settings, data, filename="in.jsonl", now=T0
        )
        opts = WorkerOptions(until_idle=True, engine=self.engine_settings, **self.worker_opts)
        self.worker = Worker(
            self.store, self.settings, opts, clock=lambda: T0 + 1,
            engine_factory=fake_factory(self.engines, self.engine_settings, **fake),
        )  # fmt: skip

    @property
    def engine(self) -> FakeEngine:
        (engine,) = self.engines  # one model, one engine
        return engine

    async def finished(self):
        rec = await self.store.get_batch(self.batch.id)
        await self.store.close()
        return rec


def test_claims_up_to_its_bound_and_completes_the_batch(tmp_path: Path) -> None:
    rig = Rig(tmp_path, EngineSettings(max_batch_size=2), claim_factor=2)

    async def main():
        await rig.open(_file(12))
        await rig.worker.run()
        return await rig.finished()

    rec = asyncio.run(main())
    assert rec.status is BatchStatus.COMPLETED
    assert rec.request_counts.completed == 12
    assert _outputs(rig.settings, rec.output_file_id) == {f"r{i}": _text(i) for i in range(12)}
    assert rig.engine.max_running == 2  # the running bound
    assert rig.engine.max_held == 4  # claim_factor × max_batch_size held at once, not all 12


def test_results_are_written_in_flushes_not_one_per_request(tmp_path: Path) -> None:
    rig = Rig(tmp_path, EngineSettings(max_batch_size=4), flush_s=1e9)
    flushes: list[int] = []

    async def main():
        await rig.open(_file(8, max_tokens=2))
        complete = rig.store.complete

        async def counted(worker_id, results, now):
            flushes.append(len(results))
            return await complete(worker_id, results, now)

        rig.store.complete = counted  # type: ignore[method-assign]
        await rig.worker.run()
        return await rig.finished()

    rec = asyncio.run(main())
    assert rec.status is BatchStatus.COMPLETED
    assert flushes == [4, 4]  # a flush when max_batch_size results wait (the timer never fires)


def test_cancel_mid_batch_aborts_the_running_requests_and_keeps_finished_ones(
    tmp_path: Path,
) -> None:
    rig = Rig(tmp_path, EngineSettings(max_batch_size=1))

    async def main():
        await rig.open(_file(4, max_tokens=3))
        while not rig.engines or rig.engine.steps < 4:  # r0 done (3 steps), r1 one token in
            await rig.worker.tick()
        await batches.lifecycle.cancel(rig.store, rig.batch.id, now=T0 + 1)
        rig.worker._next_housekeeping = 0.0  # look for cancels on the next tick, not poll_s later
        await rig.worker.run()
        return await rig.finished()

    rec = asyncio.run(main())
    assert rec.status is BatchStatus.CANCELLED
    assert _outputs(rig.settings, rec.output_file_id) == {"r0": _text(0)}
    errors = _lines(rig.settings, rec.error_file_id)
    assert [e["custom_id"] for e in errors] == ["r1", "r2", "r3"]
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    assert len(rig.engine.aborted) == 3 and not rig.engine.has_unfinished()


def test_a_preempted_request_is_recomputed_and_recorded_once(tmp_path: Path) -> None:
    rig = Rig(tmp_path, EngineSettings(max_batch_size=2))
    victim = tuple(TOK.encode("pb"))

    async def main():
        await rig.open(_file(3), preempt=frozenset({victim}))
        await rig.worker.run()
        return await rig.finished()

    rec = asyncio.run(main())
    assert len(rig.engine.preempted) == 1
    assert rig.engine.admitted.count(rig.engine.preempted[0]) == 2  # admitted again, later
    assert rec.status is BatchStatus.COMPLETED and rec.request_counts.completed == 3
    assert _outputs(rig.settings, rec.output_file_id) == {f"r{i}": _text(i) for i in range(3)}


def test_online_requests_are_admitted_before_waiting_batch_work(tmp_path: Path) -> None:
    rig = Rig(tmp_path, EngineSettings(max_batch_size=1))

    async def main():
        await rig.open(_file(3))
        await rig.worker.tick()  # claims the batch: r0 runs, r1 and r2 wait
        ticket = rig.worker.online.submit(
            "/v1/completions", {"model": "default", "prompt": "zz", "max_tokens": 2}
        )
        await rig.worker.run()
        events = []
        while not ticket.events.empty():
            events.append(ticket.events.get_nowait())
        return await rig.finished(), events

    rec, events = asyncio.run(main())
    admitted = rig.engine.admitted
    assert len(admitted) == 4 and admitted[1].startswith("-")  # the ticket, before r1 and r2
    done = events[-1]
    assert isinstance(done, DoneEvent) and done.status_code == 200
    assert done.body["choices"][0]["text"] == TOK.decode(expected_tokens(TOK.encode("zz"), 2))
    assert len(events) == 3  # a token event per token, then done
    assert rec.status is BatchStatus.COMPLETED


def test_online_requests_start_before_the_looks_for_other_work_and_only_one_tick(tmp_path):
    """Online requests that came during a round start in the next one at once: that tick's
    housekeeping queries and claim (5-15 ms under a batch, issue 49) wait a tick, and no more
    than one: the tick after runs them even when more requests wait."""
    rig = Rig(tmp_path, EngineSettings(max_batch_size=1))
    body = {"model": "default", "prompt": "zz", "max_tokens": 2}
    calls: list[str] = []

    async def main():
        await rig.open(_file(3))
        await rig.worker.tick()  # claims the batch: r0 runs, r1 and r2 wait
        end_batches, claim = rig.worker.housekeeping.end_batches, rig.worker.admission.claim

        async def spied_end_batches():
            calls.append("end_batches")
            return await end_batches()

        async def spied_claim():
            calls.append("claim")
            return await claim()

        rig.worker.housekeeping.end_batches = spied_end_batches  # type: ignore[method-assign]
        rig.worker.admission.claim = spied_claim  # type: ignore[method-assign]
        for _ in range(2):
            rig.worker._next_housekeeping = 0.0  # due at this tick
            rig.worker.online.submit("/v1/completions", body)
            await rig.worker.tick()
            calls.append(f"added {[r for r in rig.engine.priorities if r.startswith('-')]}")
        two_ticks = list(calls)
        await rig.worker.run()
        return await rig.finished(), two_ticks

    rec, two_ticks = asyncio.run(main())
    assert two_ticks == [
        "added ['-1:0']",  # to the engine at once, the looks for other work put off
        "end_batches", "claim", "added ['-1:0', '-2:0']",  # put off one tick at most
    ]  # fmt: skip
    assert rec.status is BatchStatus.COMPLETED and rec.request_counts.completed == 3


def test_claims_follow_the_engines_running_width_not_the_hard_cap(tmp_path, monkeypatch):
    # the hard cap is 256 (claim_factor 2 would hold 512); the engine runs 3 wide
    monkeypatch.setattr(FakeEngine, "running_limit", 3, raising=False)
    rig = Rig(tmp_path, EngineSettings(max_batch_size=256), claim_factor=2)

    async def main():
        await rig.open(_file(20))
        rig.worker.load()
        await rig.worker.run()
        return await rig.finished()

    rec = asyncio.run(main())
    assert rec.request_counts.completed == 20
    assert rig.engine.max_held == 6  # claim_factor x the engine's width


def test_before_its_engine_loads_a_worker_claims_by_the_initial_width(tmp_path: Path) -> None:
    rig = Rig(tmp_path, EngineSettings(max_batch_size=256), claim_factor=1)

    async def main():
        await rig.open(_file(100))
        await rig.worker.run()
        return await rig.finished()

    rec = asyncio.run(main())
    assert rec.request_counts.completed == 100
    assert rig.engine.max_held == 32  # the adaptive width's start, not 256


def test_a_more_urgent_batch_is_claimed_first_at_its_engine_priority(tmp_path: Path) -> None:
    """metadata.priority "-3" (lower runs first, as vLLM's) goes before an older batch at 0,
    and its lines enter the engine at its engine priority, behind online work."""
    rig = Rig(tmp_path, EngineSettings(max_batch_size=1), claim_factor=1)

    async def main():
        await rig.open(_file(2))  # priority 0, the older
        urgent = await batches.intake.submit(
            rig.store, rig.settings, _file(2), filename="urgent.jsonl", now=T0 + 0.5,
            metadata={"priority": "-3"},
        )  # fmt: skip
        assert urgent.priority == -3 and urgent.metadata == {"priority": "-3"}
        await rig.worker.run()
        return await rig.finished(), await _priorities(rig)

    async def _priorities(rig: Rig) -> dict[str, int]:
        return {b.id: b.priority for b in await rig.store.list_batches()}

    rec, prios = asyncio.run(main())
    assert rec.status is BatchStatus.COMPLETED
    assert sorted(prios.values()) == [-3, 0]
    rows = [int(rid.split(":")[0]) for rid in rig.engine.admitted]
    assert rows == [3, 4, 1, 2]  # the urgent batch's lines (rows 3, 4) first
    assert [rig.engine.priorities[r] for r in rig.engine.admitted] == (
        [engine_priority(-3)] * 2 + [engine_priority(0)] * 2
    )


def test_a_model_that_cannot_load_fails_each_line_once_without_retrying_per_line(
    tmp_path: Path, caplog: Any
) -> None:
    settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache", poll_s=0.01)
    builds: list[str] = []

    def build(name: str) -> Any:
        builds.append(name)
        raise ValueError("model.gguf cannot be read as GGUF: the tensor data ends early")

    async def main():
        store = await Store.open(settings.db_path)
        batch = await batches.intake.submit(store, settings, _file(6), filename="in.jsonl", now=T0)
        opts = WorkerOptions(until_idle=True, engine=EngineSettings(max_batch_size=4))
        worker = Worker(store, settings, opts, clock=lambda: T0 + 1, engine_factory=build)
        await worker.run()
        rec = await store.get_batch(batch.id)
        await store.close()
        return rec

    with caplog.at_level("ERROR", logger="batchmlx.worker"):
        rec = asyncio.run(main())
    assert rec.request_counts.failed == 6 and rec.request_counts.completed == 0
    assert builds == ["default"]  # tried once, not once per line
    errors = _lines(settings, rec.error_file_id)
    assert len(errors) == 6
    for line in errors:
        body = line["response"]["body"]["error"]
        assert line["response"]["status_code"] == 500
        assert "the model 'default' cannot be loaded: model.gguf cannot be read" in body["message"]
    logged = [r for r in caplog.records if "cannot be loaded" in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is None  # one line, no traceback
