"""Connection settings: WAL, busy timeout, and BEGIN IMMEDIATE for writes only."""

from __future__ import annotations

import asyncio
import sqlite3

import pytest
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from batchmlx.store import Store

from .conftest import add_batch, batch, new_requests

pytestmark = pytest.mark.dialects("sqlite")  # SQLite's pragmas and locking


def test_pragmas_on_every_connection(with_store):
    pragmas = with_store(lambda store: store.pragmas())
    assert pragmas == {
        "journal_mode": "wal",
        "busy_timeout": 30000,
        "synchronous": 1,  # NORMAL
        "foreign_keys": 1,
    }


def test_writes_begin_immediate_and_reads_deferred(with_store):
    async def scenario(store: Store) -> list[str]:
        seen: list[str] = []

        @event.listens_for(store._engine.sync_engine, "before_cursor_execute")
        def record(conn, cursor, statement, *args):  # noqa: ARG001
            words = statement.split()
            seen.append(" ".join(words[:2]) if words[0] == "BEGIN" else words[0])

        await add_batch(store, batch("batch_a"), new_requests(2))
        await store.get_batch("batch_a")
        await store.claim("w1", 1, now=1.0, lease_s=10.0)
        return seen

    seen = with_store(scenario)
    create_batch = ["BEGIN IMMEDIATE", "INSERT"]  # the batch, validating
    create_batch += ["BEGIN IMMEDIATE", "SELECT", "INSERT", "UPDATE"]  # requests in, started
    get_batch = ["BEGIN DEFERRED", "SELECT", "SELECT"]
    claim = ["BEGIN IMMEDIATE", "UPDATE", "SELECT"]
    assert seen == create_batch + get_batch + claim


def test_reads_proceed_while_another_connection_holds_the_write_lock(db_path):
    async def scenario() -> None:
        store = await Store.open(db_path, busy_timeout_s=0.2)
        try:
            await add_batch(store, batch("batch_a"), new_requests(3))
            holder = sqlite3.connect(db_path, isolation_level=None)
            holder.execute("BEGIN IMMEDIATE")
            try:
                rec = await store.get_batch("batch_a")  # WAL: readers never wait
                assert rec is not None and rec.request_counts.total == 3
                with pytest.raises(OperationalError, match="locked"):
                    await store.claim("w1", 1, now=1.0, lease_s=10.0)  # waits 0.2 s, gives up
            finally:
                holder.execute("ROLLBACK")
                holder.close()
            assert len(await store.claim("w1", 1, now=1.0, lease_s=10.0)) == 1
        finally:
            await store.close()

    asyncio.run(scenario())
