"""A worker stand-in for the two-process test: claim and complete until the queue is empty.

Usage: python claimer.py DB WORKER_ID READY_FILE GO_FILE OUT_FILE
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from batchmlx.core.lifecycle import RequestStatus
from batchmlx.core.records import RequestResult
from batchmlx.store import Store


async def main(db: str, worker_id: str, ready: Path, go: Path, out: Path) -> None:
    store = await Store.open(db)
    ready.touch()
    while not go.exists():
        await asyncio.sleep(0.005)
    claimed: list[int] = []
    recorded = 0
    try:
        while True:
            batch = await store.claim(worker_id, 5, now=time.time(), lease_s=600.0)
            if not batch:
                break
            claimed += [c.id for c in batch]
            await store.heartbeat(worker_id, now=time.time(), lease_s=600.0)
            result = RequestResult(RequestStatus.SUCCEEDED, 200, {"by": worker_id})
            recorded += await store.complete(
                worker_id, [(c.id, result) for c in batch], now=time.time()
            )
    finally:
        await store.close()
    out.write_text(json.dumps({"claimed": claimed, "recorded": recorded}))


if __name__ == "__main__":
    db, worker_id, ready, go, out = sys.argv[1:6]
    asyncio.run(main(db, worker_id, Path(ready), Path(go), Path(out)))
