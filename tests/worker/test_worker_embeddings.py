"""/v1/embeddings in the real Worker on a fake engine: the embedder is the engine seam's
EmbedderProtocol (ServingModel.embedder); without one, or when its pass fails, the requests get a
500 line and the batch still completes."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from batchmlx import batches
from batchmlx.config import Settings
from batchmlx.core.engine_api import EngineSettings
from batchmlx.core.lifecycle import BatchStatus
from batchmlx.store import Store
from batchmlx.worker import Worker, WorkerOptions
from batchmlx.worker.build import ServingModel
from batchmlx.worker.translate import Translator

from .fake_engine import FakeEngine, FakeTokenizer

T0 = 1_000_000.0
DIMS = 4


class FakeEmbedder:
    dimensions = DIMS

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.passes: list[int] = []

    def embed(self, inputs: Sequence[Sequence[int]]) -> list[np.ndarray]:
        if self.fail:
            raise RuntimeError("no memory")
        self.passes.append(len(inputs))
        out = []
        for ids in inputs:
            v = np.array([len(ids), sum(ids) % 7, 1.0, 2.0], dtype=np.float32)
            out.append(v / np.linalg.norm(v))
        return out


def _file(n: int) -> bytes:
    lines = [
        {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "default", "input": ["ab" * (i + 1), "c"]}}
        for i in range(n)
    ]  # fmt: skip
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def _run(tmp_path: Path, embedder: FakeEmbedder | None):
    settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache", poll_s=0.01)
    engine_settings = EngineSettings(max_batch_size=4)

    def build(name: str) -> ServingModel:
        engine = FakeEngine(engine_settings)
        translator = Translator(FakeTokenizer(), "fake-model", engine.max_context_tokens, [])
        return ServingModel(name, engine, translator, embedder)

    async def main():
        store = await Store.open(settings.db_path)
        rec = await batches.intake.submit(store, settings, _file(3), filename="e.jsonl", now=T0)
        opts = WorkerOptions(until_idle=True, engine=engine_settings)
        worker = Worker(store, settings, opts, clock=lambda: T0 + 1, engine_factory=build)
        await worker.run()
        rec = await store.get_batch(rec.id)
        out = await batches.files.file_content(store, rec.output_file_id)
        err = await batches.files.file_content(store, rec.error_file_id)
        await store.close()
        return rec, [json.loads(x) for x in out.splitlines()], [
            json.loads(x) for x in err.splitlines()
        ]

    return asyncio.run(main())


def test_embeddings_run_in_one_batched_pass(tmp_path: Path) -> None:
    embedder = FakeEmbedder()
    rec, out, err = _run(tmp_path, embedder)
    assert rec.status is BatchStatus.COMPLETED and not err
    assert rec.request_counts.completed == 3
    assert embedder.passes == [6]  # three requests of two inputs, one pass
    body = out[0]["response"]["body"]
    assert body["object"] == "list" and len(body["data"]) == 2
    assert len(body["data"][0]["embedding"]) == DIMS
    assert rec.model == "fake-model"  # the model actually used, set at finalize


def test_no_embedder_or_a_failed_pass_is_a_500_per_request(tmp_path: Path) -> None:
    for i, embedder in enumerate((None, FakeEmbedder(fail=True))):
        rec, out, err = _run(tmp_path / str(i), embedder)
        assert rec.status is BatchStatus.COMPLETED and not out
        assert [e["response"]["status_code"] for e in err] == [500, 500, 500]
