"""Finalize runs once per batch, whichever host finishes last."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchmlx.batches.files import file_content
from batchmlx.batches.finalize import finalize
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.store import Store
from tests.store.conftest import add_batch, batch, failed, new_requests, ok

REPO = Path(__file__).resolve().parents[2]


# on SQLite the "hosts" are processes of one host sharing the database file: an flock per batch
def test_hosts_racing_to_finalize_write_each_file_once(store_target, tmp_path):
    async def scenario() -> None:
        hosts = [await Store.open(store_target, files_dir=tmp_path / f"h{i}") for i in range(3)]
        saves: list[str] = []
        for h in hosts:
            real = h.save_file

            async def counted(file_id, *args, _real=real, **kw):
                saves.append(file_id)
                await asyncio.sleep(0)  # let the other hosts run in between
                return await _real(file_id, *args, **kw)

            h.save_file = counted
        try:
            a = hosts[0]
            await add_batch(a, batch("batch_a"), new_requests(4))
            claimed = await a.claim("w1", 4, now=1.0, lease_s=30.0)
            results = [(c.id, ok() if c.line != 2 else failed()) for c in claimed]
            await a.complete("w1", results, now=2.0)
            settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache")
            recs = await asyncio.gather(
                *(finalize(h, settings, "batch_a", now=3.0) for h in hosts * 3)
            )
            assert sorted(saves) == sorted({*saves}) and len(saves) == 2  # output + errors
            final = await a.get_batch("batch_a")
            assert final.status is BatchStatus.COMPLETED
            assert {r.status for r in recs} <= {BatchStatus.FINALIZING, BatchStatus.COMPLETED,
                                                BatchStatus.IN_PROGRESS}  # fmt: skip
            out = await file_content(hosts[2], final.output_file_id)
            assert len(out.splitlines()) == 3
        finally:
            for h in hosts:
                await h.close()

    asyncio.run(scenario())


LOCK_HOLDER = """
import asyncio, sys
from batchmlx.store import Store

async def main(target):
    store = await Store.open(target)
    async with store.batch_lock("batch_a") as mine:
        print("held" if mine else "not held", flush=True)
        await asyncio.sleep(600)

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.dialects("sqlite")
def test_sqlite_batch_lock_excludes_other_processes_and_dies_with_its_holder(
    store_target, tmp_path
):
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(store_target)], stdout=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"

        async def scenario() -> None:
            store = await Store.open(store_target)
            try:
                await add_batch(store, batch("batch_a"), new_requests(1))
                claimed = await store.claim("w1", 1, now=1.0, lease_s=30.0)
                await store.complete("w1", [(claimed[0].id, ok())], now=2.0)
                settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache")
                # the other process holds the batch: this finalize leaves it to that one
                rec = await finalize(store, settings, "batch_a", now=3.0)
                assert rec.status is BatchStatus.IN_PROGRESS and rec.output_file_id is None
                holder.kill()  # SIGKILL: its lock goes with it
                holder.wait(30)
                rec = await finalize(store, settings, "batch_a", now=4.0)
                assert rec.status is BatchStatus.COMPLETED
                assert not list((store_target.parent / "locks").iterdir())  # none left behind
            finally:
                await store.close()

        asyncio.run(scenario())
    finally:
        holder.kill()
        holder.wait(30)
