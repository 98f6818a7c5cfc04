"""Cancel and finalize racing, in-process on a real SQLite file: each side reads the batch,
then the other moves it before this side writes. Neither may raise; the batch ends once."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from batchmlx import batches
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.store import Store
from tests.store.conftest import add_batch, batch, new_requests, ok
from tests.store_scenario import run_with_store


class _Late(Store):
    """A store whose next `get_batch` runs `before` first: the other side's move, landing just
    after this side read (what a second process does between our read and our write)."""

    def __init__(self, inner: Store) -> None:
        self.__dict__.update(inner.__dict__)  # the same engine, dialect and file storage
        self.before = None

    async def get_batch(self, batch_id: str):
        rec = await super().get_batch(batch_id)
        if self.before is not None:
            act, self.before = self.before, None
            await act()
        return rec


async def _done_batch(store: Store) -> None:
    await add_batch(store, batch("batch_r", created_at=int(time.time())), new_requests(2))
    claimed = await store.claim("w1", 2, now=time.time(), lease_s=60)
    await store.complete("w1", [(c.id, ok()) for c in claimed], now=time.time())


def test_cancel_arriving_while_finalize_reads(tmp_path: Path) -> None:
    async def scenario(store: Store, settings) -> None:
        await _done_batch(store)
        late = _Late(store)
        late.before = lambda: batches.lifecycle.cancel(store, "batch_r", now=time.time())
        rec = await batches.finalize.finalize(late, settings, "batch_r", now=time.time())
        assert rec.status is BatchStatus.CANCELLING  # left for the canceller's settle
        rec = await batches.lifecycle.settle_cancelling(store, settings, "batch_r", now=time.time())
        assert rec.status is BatchStatus.CANCELLED
        assert rec.request_counts.completed == 2 and rec.output_file_id

    run_with_store(tmp_path, scenario)


def test_cancel_of_a_batch_that_began_finalizing_meanwhile(tmp_path: Path) -> None:
    async def scenario(store: Store, settings) -> None:
        await _done_batch(store)
        late = _Late(store)
        late.before = lambda: store.set_batch_status("batch_r", BatchStatus.FINALIZING,
                                                     time.time())  # fmt: skip
        with pytest.raises(batches.BatchError, match="status .finalizing."):
            await batches.lifecycle.cancel(late, "batch_r", now=time.time())

    run_with_store(tmp_path, scenario)
