"""What several hosts on one database rely on: skipped locked rows, wake-ups, the database's
clock, the per-batch lock, and file bytes every host can read."""

from __future__ import annotations

import asyncio
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from batchmlx.core.lifecycle import BatchStatus
from batchmlx.database_url import parse_target
from batchmlx.store import Store
from batchmlx.store.types import FileStorage

from .conftest import add_batch, batch, new_requests

LEASE = 30.0
REPO = Path(__file__).resolve().parents[2]
HOLD_LOCK = """
import asyncio, sys
from batchmlx.store import Store
async def main():
    store = await Store.open(sys.argv[1])
    async with store.batch_lock("batch_z") as mine:
        print("held" if mine else "not held", flush=True)
        await asyncio.sleep(3600)
asyncio.run(main())
"""
pg_only = pytest.mark.dialects("postgresql")


def _two_stores(store_target, fn):
    """`fn(a, b)` with two stores on one database: two hosts."""

    async def main():
        a = await Store.open(store_target)
        b = await Store.open(store_target)
        try:
            return await fn(a, b)
        finally:
            await a.close()
            await b.close()

    return asyncio.run(main())


@pg_only
def test_claim_skips_rows_another_transaction_holds(store_target):
    async def scenario(a: Store, b: Store) -> None:
        await add_batch(a, batch("batch_a"), new_requests(4))
        engine = create_async_engine(parse_target(store_target).url)
        try:
            async with engine.begin() as conn:  # another host mid-claim holds lines 1 and 2
                await conn.execute(text("SELECT id FROM requests WHERE line <= 2 FOR UPDATE"))
                got = await b.claim("w2", 10, now=1.0, lease_s=LEASE)  # does not wait
                assert [c.line for c in got] == [3, 4]
        finally:
            await engine.dispose()
        assert [c.line for c in await a.claim("w1", 10, now=1.0, lease_s=LEASE)] == [1, 2]

    _two_stores(store_target, scenario)


@pg_only
def test_concurrent_claims_on_many_connections_are_disjoint(store_target):
    async def scenario(a: Store, b: Store) -> None:
        await add_batch(a, batch("batch_a"), new_requests(300))

        async def drain(store: Store, worker: str) -> list[int]:
            ids: list[int] = []
            while got := await store.claim(worker, 7, now=1.0, lease_s=LEASE):
                ids += [c.id for c in got]
            return ids

        runs = await asyncio.gather(*(drain(s, f"w{i}") for i, s in enumerate((a, b) * 3)))
        every = [i for run in runs for i in run]
        assert len(every) == len(set(every)) == 300

    _two_stores(store_target, scenario)


@pg_only
def test_an_idle_store_wakes_on_new_work_from_another_host(store_target):
    async def scenario(a: Store, b: Store) -> None:
        assert a.listens and b.listens
        await a.wait_for_work(0.01)  # listening from now on (the first call may wake at once)
        waiting = asyncio.ensure_future(a.wait_for_work(600))
        await asyncio.sleep(0)
        await add_batch(b, batch("batch_a"), new_requests(1))
        assert await waiting is True  # woken by the NOTIFY, not by the 600 s timeout
        for event in ("cancel", "release"):
            waiting = asyncio.ensure_future(a.wait_for_work(600))
            await asyncio.sleep(0)
            if event == "release":
                (c,) = await b.claim("w1", 1, now=1.0, lease_s=LEASE)
                await b.release("w1", [c.id])
            else:
                await add_batch(b, batch("batch_b", created_at=2000))
                await b.set_batch_status("batch_b", BatchStatus.CANCELLING, now=2.0)
            assert await waiting is True, event
        # the server drops the listening connection: the next wait listens again
        async with b._engine.connect() as conn:
            await conn.execute(text(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE query LIKE 'LISTEN%' AND pid <> pg_backend_pid()"
            ))  # fmt: skip
            await conn.commit()
        deadline = time.monotonic() + 60
        while a._listener._raw is not None and not a._listener._raw.is_closed():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await a.wait_for_work(0.01)  # reconnects (and looks once)
        waiting = asyncio.ensure_future(a.wait_for_work(600))
        await asyncio.sleep(0)
        await add_batch(b, batch("batch_c", created_at=3000), new_requests(1, "c"))
        assert await waiting is True

    _two_stores(store_target, scenario)


@pg_only
def test_clock_is_the_databases_whatever_this_hosts_clock_says(store_target, monkeypatch):
    async def scenario(a: Store, b: Store) -> None:
        async with a._reader.connect() as conn:
            db_now = (await conn.execute(text("SELECT extract(epoch FROM now())::float8"))).scalar()
        assert abs(a.clock() - db_now) < 5.0
        monkeypatch.setattr(time, "time", lambda: 0.0)  # a host whose clock is off by decades
        await a.heartbeat("w1", now=a.clock(), lease_s=LEASE)
        assert abs(a.clock() - db_now) < 5.0
        assert await b.live_workers(b.clock(), within_s=LEASE) == ["w1"]

    _two_stores(store_target, scenario)


@pg_only
def test_batch_lock_is_held_by_one_host_at_a_time_and_dies_with_its_connection(store_target):
    async def scenario(a: Store, b: Store) -> None:
        async with a.batch_lock("batch_x") as mine:
            assert mine
            async with b.batch_lock("batch_x") as theirs:
                assert not theirs
            async with b.batch_lock("batch_y") as other:
                assert other  # other batches are free
        async with b.batch_lock("batch_x") as theirs:
            assert theirs
        # a host killed holding it: its connection goes, and the lock with it
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD_LOCK, str(store_target)],
            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        try:
            assert holder.stdout.readline().strip() == "held"
            async with b.batch_lock("batch_z") as theirs:
                assert not theirs
        finally:
            holder.kill()
            holder.wait()
        deadline = time.monotonic() + 60
        while True:  # the server sees the socket close; poll rather than guess how long
            async with b.batch_lock("batch_z") as theirs:
                if theirs:
                    break
            assert time.monotonic() < deadline, "the dead host's lock was never released"
            await asyncio.sleep(0.05)

    _two_stores(store_target, scenario)


@pg_only
def test_sqlite_stays_one_host_and_postgresql_shares_files_by_default(store_target, tmp_path):
    async def scenario() -> None:
        pg = await Store.open(store_target)
        lite = await Store.open(tmp_path / "x.db")
        try:
            assert pg.files is FileStorage.DATABASE and not pg.one_host
            assert lite.files is FileStorage.LOCAL and lite.one_host and not lite.listens
        finally:
            await pg.close()
            await lite.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("storage", list(FileStorage))
def test_files_stream_in_and_out_atomically_and_identically(store_target, storage, tmp_path):
    chunk = bytes(range(256)) * 4096  # 1 MiB
    pieces = [chunk[: 1 + (i * 7919) % len(chunk)] for i in range(5)]  # uneven pieces
    data = b"".join(pieces)

    async def scenario() -> None:
        store = await Store.open(store_target, files=storage, files_dir=tmp_path / "files")
        other = await Store.open(store_target, files=storage, files_dir=tmp_path / "files")
        try:

            async def gen():
                for p in pieces:
                    yield p

            rec = await store.save_file(
                "file-a", gen(), filename="a.jsonl", purpose="batch", created_at=1
            )
            assert rec.bytes == len(data)
            got = await other.get_file("file-a")  # another host reads the same bytes
            assert got == rec
            for _ in range(2):  # byte-identical on every fetch
                assert await other.read_file_bytes(got) == data
            # a replace (finalize redone) swaps all of it
            new = await store.save_file(
                "file-a", [b"x\n"], filename="a.jsonl", purpose="batch", created_at=1, replace=True
            )
            assert await other.read_file_bytes(new) == b"x\n"
            await store.delete_file_bytes(new)
            if storage is FileStorage.DATABASE:
                assert await other.read_file_bytes(new) == b""
        finally:
            await store.close()
            await other.close()

    asyncio.run(scenario())
    assert hashlib.sha256(data).hexdigest()  # (data built as intended)
