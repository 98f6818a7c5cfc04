"""Finalize runs once per batch, whichever host finishes last."""

from __future__ import annotations

import asyncio

import pytest

from batchmlx.batches.files import file_content
from batchmlx.batches.finalize import finalize
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.store import Store
from tests.store.conftest import add_batch, batch, failed, new_requests, ok


# SQLite (one host) keeps its old rule: BEGIN IMMEDIATE orders the status moves and a second
# finalize writes the same bytes again
@pytest.mark.dialects("postgresql")
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
