"""https images on the real path: a tiny random-weight LLaVA (tests/tiny_vlm.py) in the real
Worker and MLX engine, on a real SQLite queue, its images fetched from a local https server
(tests/https_server.py, loopback, its own CA). An image whose server trickles a byte at a time
holds up no text line (they all finish long before its fetch's deadline), and then gets its
400 at that deadline; an image fetched over https is answered."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from batchmlx import batches
from batchmlx.config import MediaSettings, Settings
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.store import Store
from batchmlx.worker import Worker, WorkerOptions
from batchmlx.worker.build import mlx_engine_factory
from batchmlx.worker.fetch import HttpsFetch
from batchmlx.worker.media import MediaReader
from tests.https_server import HttpsServer
from tests.tiny_vlm import png

pytest.importorskip("mlx_vlm")
pytest.importorskip("cryptography")

DEADLINE_S = 8.0
TEXTS = 16


def chat(content, max_tokens: int = 8) -> dict:
    return {"model": "gpt-4o-mini", "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": content}]}  # fmt: skip


def image(url: str) -> list:
    return [{"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "What is in this picture?"}]  # fmt: skip


def test_a_stalled_https_image_holds_up_no_text_line(tmp_path: Path, tiny_vlm_dir: Path):
    server = HttpsServer(tmp_path, files={"/cat.png": (png(1), "image/png")})
    lines = [("stalled", chat(image(server.url("/trickle")))),
             ("fetched", chat(image(server.url("/cat.png"))))]  # fmt: skip
    lines += [(f"t{i}", chat(f"Say something about the number {i}.")) for i in range(TEXTS)]
    data = "".join(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                               "body": body}) + "\n" for cid, body in lines).encode()  # fmt: skip
    settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache", poll_s=0.05,
                        media=MediaSettings(fetch_private=True))  # fmt: skip
    opts = WorkerOptions(until_idle=True, model=str(tiny_vlm_dir))
    build = mlx_engine_factory(cache_dir=settings.cache_dir, dtype="auto", engine=opts.engine,
                               media=settings.media)  # fmt: skip

    def factory(name: str):
        serving = build(name)
        # the one test-only part: a client context that trusts the test server's own CA
        fetch = HttpsFetch(timeout_s=DEADLINE_S, allow_private=True,
                           ssl_context=server.client_context())  # fmt: skip
        serving.translator.media = MediaReader(fetch=fetch)
        return serving

    async def main():
        store = await Store.open(settings.db_path)
        batch = await batches.intake.submit(
            store, settings, data, filename="in.jsonl", now=store.clock()
        )
        worker = Worker(store, settings, opts, engine_factory=factory)
        await asyncio.to_thread(worker.load)  # the model's load is not what is measured
        start = time.monotonic()
        run = asyncio.create_task(worker.run())
        texts_at = None
        while not run.done():
            counts = (await store.get_batch(batch.id)).request_counts
            if texts_at is None and counts.completed >= TEXTS + 1:
                texts_at = time.monotonic() - start
            await asyncio.sleep(0.05)
        await run
        took = time.monotonic() - start
        rec = await store.get_batch(batch.id)
        await store.close()
        return rec, texts_at, took

    try:
        rec, texts_at, took = asyncio.run(main())
    finally:
        server.close()
    print(f"text lines done after {texts_at} s; the batch after {took:.1f} s")
    assert rec.status is BatchStatus.COMPLETED
    assert (rec.request_counts.completed, rec.request_counts.failed) == (TEXTS + 1, 1)
    assert texts_at is not None and texts_at < DEADLINE_S - 1  # before the stalled fetch ended
    assert took >= DEADLINE_S - 0.5  # the stalled line ended at its deadline, not before
    errors = [json.loads(x) for x in (settings.files_dir / rec.error_file_id).read_text()
              .splitlines()]  # fmt: skip
    (err,) = errors
    body = err["response"]["body"]["error"]
    assert (err["custom_id"], err["response"]["status_code"]) == ("stalled", 400)
    assert body["param"] == "messages[0].content[0].image_url.url"
    assert f"longer than its {DEADLINE_S:g} s limit" in body["message"]
