"""Two worker processes on one database file, and a large batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from batchmlx.core.records import RequestCounts
from batchmlx.store import NewRequest, Store

from .conftest import add_batch, batch, new_requests

REPO = Path(__file__).resolve().parents[2]
CLAIMER = Path(__file__).with_name("claimer.py")


def test_two_processes_claim_disjoint_sets_without_locking_errors(
    with_store, store_target, tmp_path
):
    n = 2000

    async def setup(store: Store) -> None:
        await add_batch(store, batch("batch_a", created_at=1), new_requests(n // 2, "a"))
        await add_batch(store, batch("batch_b", created_at=2), new_requests(n // 2, "b"))

    with_store(setup)
    go = tmp_path / "go"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    procs = []
    for w in ("w1", "w2"):
        args = [store_target, w, tmp_path / f"{w}.ready", go, tmp_path / f"{w}.json"]
        procs.append(
            subprocess.Popen(
                [sys.executable, str(CLAIMER), *map(str, args)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"{w}.ready").exists() for w in ("w1", "w2")):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.01)
    go.touch()
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert "database is locked" not in err
        assert p.returncode == 0, err

    outs = [json.loads((tmp_path / f"{w}.json").read_text()) for w in ("w1", "w2")]
    claimed = [set(o["claimed"]) for o in outs]
    assert all(
        len(c) == len(o["claimed"]) == o["recorded"] for c, o in zip(claimed, outs, strict=True)
    )
    assert not claimed[0] & claimed[1]
    assert len(claimed[0] | claimed[1]) == n
    assert all(claimed)  # both took part
    print(f"\nclaimed per worker: {[len(c) for c in claimed]}")

    async def check(store: Store) -> None:
        for b in ("batch_a", "batch_b"):
            assert (await store.get_batch(b)).request_counts == RequestCounts(n // 2, n // 2, 0)
        assert await store.batches_to_finalize() == ["batch_a", "batch_b"]

    with_store(check)


def test_create_batch_with_50000_requests(with_store):
    n = 50_000
    body = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 40}]}
    requests = [NewRequest(line=i + 1, custom_id=f"r{i}", body=body) for i in range(n)]

    async def scenario(store: Store) -> float:
        start = time.perf_counter()
        await add_batch(store, batch("batch_big"), requests)
        elapsed = time.perf_counter() - start
        assert (await store.get_batch("batch_big")).request_counts == RequestCounts(total=n)
        claimed = await store.claim("w1", 256, now=1.0, lease_s=30.0)
        assert [c.line for c in claimed] == list(range(1, 257))
        return elapsed

    elapsed = with_store(scenario)
    print(f"\ncreate_batch of {n} requests: {elapsed:.2f} s")
