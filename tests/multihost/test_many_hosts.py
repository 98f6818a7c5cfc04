"""Workers on several hosts, one PostgreSQL queue: every custom_id exactly once, a killed
worker's requests finished by the others, submitters and a canceller racing the workers.

Each host is a process with its own $BATCHMLX_HOME (no shared disk) and host name; the tiny
random model with max_tokens 1 keeps the engine's part small.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from batchmlx.batches.intake import submit
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus, RequestStatus
from batchmlx.store import Store
from tests.e2e.helpers import chat_body, describe, request_line, write_jsonl
from tests.multihost.hosts import (
    custom_ids_in_files,
    make_hosts,
    rows,
    stop_all,
    wait_until_terminal,
)
from tests.store.conftest import fetch_rows

pytestmark = pytest.mark.timeout(900)


def _batch_file(path: Path, prefix: str, n: int, model: str, max_tokens: int = 1) -> Path:
    lines = [request_line(f"{prefix}-{i}", chat_body(f"Say {i}.", model=model,
                                                     max_tokens=max_tokens))
             for i in range(n)]  # fmt: skip
    return write_jsonl(path, lines)


async def _submit(store: Store, home: Path, path: Path) -> str:
    settings = Settings(home=home, cache_dir=home / "cache")
    rec = await submit(store, settings, path.read_bytes(), filename=path.name,
                       now=store.clock())  # fmt: skip
    assert rec.status is BatchStatus.IN_PROGRESS, rec.errors
    return rec.id


def test_four_hosts_2000_requests_exactly_once_with_one_worker_killed(
    pg_url, tiny_model_dir, tmp_path
):
    batches, per_batch = 4, 500
    hosts = make_hosts(tmp_path, pg_url, 4)
    submitter = tmp_path / "submitter"
    submitter.mkdir()
    inputs: dict[str, list[str]] = {}

    async def scenario() -> None:
        store = await Store.open(pg_url)
        try:
            for b in range(batches):
                path = _batch_file(tmp_path / f"in{b}.jsonl", f"b{b}", per_batch, "default")
                inputs[await _submit(store, submitter, path)] = [
                    f"b{b}-{i}" for i in range(per_batch)
                ]
            for h in hosts:
                h.start_worker("--model", tiny_model_dir, "--max-batch-size", "32")
            victim = hosts[0]
            held = await _kill_when_busy(store, victim)
            await wait_until_terminal(store, list(inputs), hosts)
            codes = stop_all(hosts)
            assert codes[victim.name] == [-signal.SIGKILL]
            assert all(c == [0] for name, c in codes.items() if name != victim.name), codes

            # another home reads every file from the database: each custom_id exactly once
            reader = await Store.open(pg_url, files_dir=tmp_path / "reader" / "files")
            try:
                for batch_id, ids in inputs.items():
                    rec = await reader.get_batch(batch_id)
                    assert rec.status is BatchStatus.COMPLETED, rec
                    seen, errors = await custom_ids_in_files(reader, batch_id)
                    assert sorted(seen) == sorted(ids) and errors == [], (batch_id, errors[:3])
            finally:
                await reader.close()

            # what the victim held when it died was finished by the other hosts
            done = await rows(store, "SELECT id, status, worker_id, attempts FROM requests "
                              f"WHERE id IN ({','.join(map(str, held))})")  # fmt: skip
            assert len(done) == len(held)
            for _id, status, worker, attempts in done:
                assert status == RequestStatus.SUCCEEDED.value
                assert not worker.startswith(f"w-{victim.name}-") and attempts >= 2
            hosts_used = await rows(
                store,
                "SELECT DISTINCT split_part(worker_id, '-', 2) || "
                "'-' || split_part(worker_id, '-', 3) FROM requests",
            )
            assert len(hosts_used) == 4, hosts_used  # all four took part
        finally:
            await store.close()
            stop_all(hosts)

    t0 = time.monotonic()
    asyncio.run(scenario())
    print(f"\n2000 requests on 4 hosts, one killed: {time.monotonic() - t0:.1f} s")
    for h in hosts:  # nothing was written to the hosts' own disks
        assert not (h.home / "files").exists() or not any((h.home / "files").iterdir())
    # the CLI of yet another home prints the same bytes
    out = hosts[1].cli("results", next(iter(inputs)))
    assert out.returncode == 0, describe(out)
    assert len(out.stdout.splitlines()) == per_batch


async def _kill_when_busy(store: Store, victim) -> list[int]:
    """SIGKILL the victim's worker once it has finished some requests while holding others;
    returns the ids it held."""
    deadline = time.monotonic() + 300
    mine = f"w-{victim.name}-%"
    while True:
        counts = dict(await rows(
            store, "SELECT status, count(*) FROM requests WHERE worker_id LIKE :w GROUP BY status",
            w=mine,
        ))  # fmt: skip
        if counts.get("succeeded", 0) > 0 and counts.get("running", 0) > 0:
            victim.procs[0].send_signal(signal.SIGKILL)
            victim.procs[0].wait()
            break
        assert victim.procs[0].poll() is None, victim.log()
        assert time.monotonic() < deadline, ("the victim never got busy", victim.log())
        await asyncio.sleep(0.05)
    held = await rows(
        store, "SELECT id FROM requests WHERE worker_id LIKE :w AND status = 'running'", w=mine
    )
    assert held
    return [h[0] for h in held]


def test_two_submitters_and_a_canceller_race_workers_of_two_models(
    pg_url, tiny_model_dir, tmp_path
):
    # two models: the tiny model and a copy of it under another name; each worker serves one
    model_a = str(tiny_model_dir)
    model_b = str(shutil.copytree(tiny_model_dir, tmp_path / "tiny-b"))
    workers = make_hosts(tmp_path, pg_url, 2, prefix="gpu")
    submitters = make_hosts(tmp_path, pg_url, 2, prefix="laptop")
    (canceller,) = make_hosts(tmp_path, pg_url, 1, prefix="phone")
    workers[0].start_worker("--only-model", model_a, "--max-batch-size", "16")
    workers[1].start_worker("--only-model", model_b, "--max-batch-size", "16")

    # submitter s sends: a long batch of its model (the one cancelled, for s = 0), then short
    # batches of both models
    plan = {
        0: [("long", model_a, 200, 64), ("short-a", model_a, 60, 1), ("short-b", model_b, 60, 1)],
        1: [("long", model_b, 60, 4), ("short-a", model_a, 60, 1), ("short-b", model_b, 60, 1)],
    }
    submitted: dict[str, tuple[str, list[str]]] = {}  # batch id -> (model, custom ids)
    to_cancel: list[str] = []
    first = threading.Event()
    failures: list[str] = []

    def submit(s: int) -> None:
        host = submitters[s]
        for name, model, n, max_tokens in plan[s]:
            path = _batch_file(host.home / f"{name}.jsonl", f"s{s}-{name}", n, model, max_tokens)
            proc = host.cli("submit", path, "--json")
            if proc.returncode != 0:
                failures.append(describe(proc))
                first.set()
                return
            obj = json.loads(proc.stdout)
            submitted[obj["id"]] = (model, [f"s{s}-{name}-{i}" for i in range(n)])
            if s == 0 and name == "long":
                to_cancel.append(obj["id"])
                first.set()

    def cancel() -> None:
        first.wait(300)
        if to_cancel:
            proc = canceller.cli("cancel", to_cancel[0], "--json")
            if proc.returncode != 0:
                failures.append(describe(proc))

    threads = [threading.Thread(target=submit, args=(s,)) for s in (0, 1)]
    threads.append(threading.Thread(target=cancel))
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    try:
        assert not failures, failures
        assert len(submitted) == 6

        async def check() -> None:
            store = await Store.open(pg_url, files_dir=tmp_path / "checker" / "files")
            try:
                await wait_until_terminal(store, list(submitted), workers)
                for batch_id, (_model, ids) in submitted.items():
                    rec = await store.get_batch(batch_id)
                    seen, errors = await custom_ids_in_files(store, batch_id)
                    assert sorted(seen) == sorted(ids), batch_id
                    if batch_id in to_cancel:
                        assert rec.status is BatchStatus.CANCELLED
                        assert errors and {e["error"]["code"] for e in errors} == {
                            "batch_cancelled"}  # fmt: skip
                    else:
                        assert rec.status is BatchStatus.COMPLETED and errors == [], batch_id
            finally:
                await store.close()

        asyncio.run(check())
        # each worker ran only the requests of its own model
        rows = fetch_rows(pg_url, "SELECT b.model, r.worker_id FROM requests r JOIN batches b "
                          "ON b.id = r.batch_id WHERE r.worker_id IS NOT NULL")  # fmt: skip
        for model, worker in rows:
            expected = workers[0] if model == model_a else workers[1]
            assert worker.startswith(f"w-{expected.name}-"), (model, worker)
    finally:
        codes = stop_all(workers)
    assert all(c == [0] for c in codes.values()), (codes, [w.log() for w in workers])
