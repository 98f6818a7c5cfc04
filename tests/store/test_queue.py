"""The queue: claim, leases, heartbeats, fenced completion, release, finalisation."""

from __future__ import annotations

from batchmlx.core.lifecycle import BatchStatus, RequestStatus
from batchmlx.core.records import RequestCounts, RequestResult
from batchmlx.store import Store

from .conftest import add_batch, batch, failed, fetch_rows, new_requests, ok

LEASE = 30.0


def _statuses(store_target) -> dict[int, tuple[str, str | None, int]]:
    rows = fetch_rows(store_target, "SELECT id, status, worker_id, attempts FROM requests")
    return {r[0]: r[1:] for r in rows}


def test_claim_takes_oldest_batch_first_in_line_order_up_to_limit(with_store):
    async def scenario(store: Store) -> None:
        await add_batch(store, batch("batch_new", created_at=200), new_requests(2, "n"))
        await add_batch(store, batch("batch_old", created_at=100), new_requests(3, "o"))
        await add_batch(store, batch("batch_wait", created_at=50, status=BatchStatus.VALIDATING))
        first = await store.claim("w1", 4, now=10.0, lease_s=LEASE)
        assert [(c.batch_id, c.line) for c in first] == [
            ("batch_old", 1),
            ("batch_old", 2),
            ("batch_old", 3),
            ("batch_new", 1),
        ]
        c = first[0]
        assert c.custom_id == "o-1" and c.attempts == 1 and c.endpoint == "/v1/chat/completions"
        assert c.model == "tiny" and c.body["messages"][0]["content"] == "q1"
        rest = await store.claim("w2", 10, now=10.0, lease_s=LEASE)
        assert [(c.batch_id, c.line) for c in rest] == [("batch_new", 2)]  # not from validating
        assert await store.claim("w3", 10, now=10.0, lease_s=LEASE) == []
        assert await store.claim("w3", 0, now=10.0, lease_s=LEASE) == []

    with_store(scenario)


def test_claim_can_be_restricted_to_one_batch(with_store):
    async def scenario(store: Store) -> None:
        await add_batch(store, batch("batch_a", created_at=100), new_requests(3, "a"))
        await add_batch(store, batch("batch_b", created_at=200), new_requests(3, "b"))
        got = await store.claim("w1", 2, now=10.0, lease_s=LEASE, batch_id="batch_b")
        assert [(c.batch_id, c.custom_id) for c in got] == [("batch_b", "b-1"), ("batch_b", "b-2")]

    with_store(scenario)


def test_complete_is_fenced_against_stale_workers(with_store):
    async def scenario(store: Store) -> None:
        await add_batch(store, batch("batch_a"), new_requests(2))
        (r1, r2) = await store.claim("w1", 2, now=100.0, lease_s=LEASE)
        # a worker that never claimed the row cannot complete it
        assert await store.complete("w2", [(r1.id, ok())], now=101.0) == 0
        assert await store.complete("w1", [(r1.id, ok())], now=101.0) == 1
        # completing twice records nothing the second time
        assert await store.complete("w1", [(r1.id, failed())], now=102.0) == 0

        # w1's lease on r2 expires; w2 re-claims it; w1's late result changes nothing
        again = await store.claim("w2", 5, now=100.0 + LEASE + 1, lease_s=LEASE)
        assert [(c.id, c.attempts) for c in again] == [(r2.id, 2)]
        assert await store.complete("w1", [(r2.id, failed(500))], now=140.0) == 0
        assert await store.complete("w2", [(r2.id, ok(completion=9))], now=141.0) == 1
        # and w2 after finishing cannot overwrite either
        assert await store.complete("w2", [(r2.id, failed())], now=142.0) == 0

        results = await store.iter_results("batch_a")
        assert [(r.custom_id, r.status, r.status_code, r.attempts) for r in results] == [
            ("req-1", RequestStatus.SUCCEEDED, 200, 1),
            ("req-2", RequestStatus.SUCCEEDED, 200, 2),
        ]
        assert results[1].completion_tokens == 9 and results[1].finished_at == 141.0

    with_store(scenario)


def test_stale_worker_after_expiry_cannot_complete_even_unclaimed(with_store):
    async def scenario(store: Store) -> None:
        await add_batch(store, batch("batch_a"), new_requests(1))
        (r1,) = await store.claim("w1", 1, now=0.0, lease_s=LEASE)
        (again,) = await store.claim("w2", 1, now=LEASE + 0.5, lease_s=LEASE)
        assert again.id == r1.id and again.attempts == 2
        assert await store.complete("w1", [(r1.id, ok())], now=LEASE + 1) == 0
        assert (await store.get_batch("batch_a")).request_counts == RequestCounts(total=1)

    with_store(scenario)


def test_unexpired_lease_is_not_reclaimed_and_heartbeat_extends_it(with_store):
    async def scenario(store: Store) -> None:
        await add_batch(store, batch("batch_a"), new_requests(3))
        await store.claim("w1", 2, now=0.0, lease_s=10.0)
        # before expiry another worker only gets the third request
        got = await store.claim("w2", 5, now=9.0, lease_s=10.0)
        assert [c.line for c in got] == [3]
        assert await store.heartbeat("w1", now=9.5, lease_s=10.0, pid=123) == 2
        # the old lease would have expired at 10; the renewed one lasts until 19.5
        assert await store.claim("w3", 5, now=15.0, lease_s=10.0) == []
        taken = await store.claim("w3", 5, now=20.0, lease_s=10.0)
        assert sorted(c.line for c in taken) == [1, 2, 3]
        assert {c.attempts for c in taken} == {2}

    with_store(scenario)


def test_heartbeat_records_live_workers(with_store, store_target):
    async def scenario(store: Store) -> None:
        assert await store.heartbeat("w1", now=100.0, lease_s=5.0, pid=11, hostname="h") == 0
        await store.heartbeat("w2", now=150.0, lease_s=5.0)
        await store.heartbeat("w1", now=160.0, lease_s=5.0)  # pid None keeps the stored pid
        assert await store.live_workers(now=170.0, within_s=15.0) == ["w1"]
        assert await store.live_workers(now=170.0, within_s=30.0) == ["w1", "w2"]

    with_store(scenario)
    sql = "SELECT pid, started_at, heartbeat_at FROM workers WHERE id='w1'"
    assert fetch_rows(store_target, sql) == [(11, 100.0, 160.0)]

    async def remove(store: Store) -> None:
        await store.remove_worker("w1")
        assert await store.live_workers(now=170.0, within_s=30.0) == ["w2"]

    with_store(remove)


def test_release_returns_requests_to_the_queue(with_store, store_target):
    async def scenario(store: Store) -> list[int]:
        await add_batch(store, batch("batch_a"), new_requests(4))
        claimed = await store.claim("w1", 4, now=0.0, lease_s=LEASE)
        ids = [c.id for c in claimed]
        assert await store.release("w2") == 0  # not its requests
        assert await store.release("w1", [ids[0]]) == 1
        assert await store.release("w1", []) == 0
        await store.complete("w1", [(ids[1], ok())], now=1.0)
        assert await store.release("w1") == 2  # the rest it still held; not the done one
        return ids

    ids = with_store(scenario)
    rows = _statuses(store_target)
    assert rows[ids[0]] == ("queued", None, 0)  # stopping is not failing: the attempt is undone
    assert rows[ids[1]] == ("succeeded", "w1", 1)
    assert rows[ids[2]] == rows[ids[3]] == ("queued", None, 0)

    async def reclaim(store: Store) -> None:
        got = await store.claim("w2", 10, now=0.0, lease_s=LEASE)
        assert [c.id for c in got] == [ids[0], ids[2], ids[3]]
        assert [c.attempts for c in got] == [1, 1, 1]

    with_store(reclaim)


def test_release_keeps_the_attempts_of_runs_that_crashed(with_store, store_target):
    """A lease taken over from a dead worker counts; the graceful release after it does not."""

    async def scenario(store: Store) -> int:
        await add_batch(store, batch("batch_a"), new_requests(1))
        (first,) = await store.claim("w1", 1, now=0.0, lease_s=LEASE)  # w1 dies holding it
        (again,) = await store.claim("w2", 1, now=LEASE + 1, lease_s=LEASE)
        assert (first.attempts, again.attempts) == (1, 2)
        for _ in range(5):  # w2.. stopped gracefully, over and over
            assert await store.release("w2") == 1
            (again,) = await store.claim("w2", 1, now=LEASE + 2, lease_s=LEASE)
            assert again.attempts == 2
        return again.id

    rid = with_store(scenario)
    assert _statuses(store_target)[rid] == ("running", "w2", 2)


def test_batches_to_finalize_and_iter_results(with_store):
    async def scenario(store: Store) -> None:
        await add_batch(store, batch("batch_a", created_at=1), new_requests(3))
        await add_batch(store, batch("batch_b", created_at=2), new_requests(1, "b"))
        claimed = await store.claim("w1", 10, now=0.0, lease_s=LEASE)
        assert await store.batches_to_finalize() == []
        by_line = {(c.batch_id, c.line): c.id for c in claimed}
        await store.complete(
            "w1",
            [(by_line["batch_a", 3], failed(400)), (by_line["batch_a", 1], ok())],
            now=1.0,
        )
        assert await store.batches_to_finalize() == []
        await store.complete(
            "w1", [(by_line["batch_a", 2], ok()), (by_line["batch_b", 1], ok())], now=2.0
        )
        assert await store.batches_to_finalize() == ["batch_a", "batch_b"]
        await store.set_batch_status("batch_b", BatchStatus.FINALIZING, now=3.0)
        # still listed: a finalize a crash interrupted is redone
        assert await store.batches_to_finalize() == ["batch_a", "batch_b"]
        await store.set_batch_status("batch_b", BatchStatus.COMPLETED, now=4.0)
        assert await store.batches_to_finalize() == ["batch_a"]

        results = await store.iter_results("batch_a")
        assert [(r.line, r.custom_id, r.status) for r in results] == [
            (1, "req-1", RequestStatus.SUCCEEDED),
            (2, "req-2", RequestStatus.SUCCEEDED),
            (3, "req-3", RequestStatus.FAILED),
        ]
        assert results[0].response_body == {"object": "chat.completion", "choices": []}
        assert results[0].cache_outcome == "MISS" and results[0].error is None
        assert results[2].status_code == 400
        assert results[2].response_body["error"]["type"] == "invalid_request_error"

    with_store(scenario)


def test_finish_unfinished_gives_every_open_request_the_result(with_store):
    expired = RequestResult(
        status=RequestStatus.FAILED,
        status_code=400,
        body=None,
        error={"code": "batch_expired", "message": "expired before it could run"},
    )

    async def scenario(store: Store) -> None:
        await add_batch(store, batch("batch_a"), new_requests(4))
        c = await store.claim("w1", 2, now=0.0, lease_s=LEASE)
        await store.complete("w1", [(c[0].id, ok())], now=1.0)
        await store.set_batch_status("batch_a", BatchStatus.CANCELLING, now=2.0)
        assert await store.finish_unfinished("batch_a", expired, now=3.0) == 3
        assert await store.complete("w1", [(c[1].id, ok())], now=4.0) == 0  # too late
        counts = (await store.get_batch("batch_a")).request_counts
        assert counts == RequestCounts(total=4, completed=1, failed=3)
        errors = [r.error for r in await store.iter_results("batch_a")]
        assert errors == [None] + [expired.error] * 3

    with_store(scenario)
