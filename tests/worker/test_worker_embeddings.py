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

from .fake_engine import VOCAB, FakeEngine, FakeTokenizer

T0 = 1_000_000.0
DIMS = 4


class FakeEmbedder:
    dimensions = DIMS

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail
        self.passes: list[int] = []

    def slices(self, inputs: Sequence[Sequence[int]]):
        yield list(enumerate(self.embed(inputs)))

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


def _run(tmp_path: Path, embedder: FakeEmbedder | None, data: bytes | None = None):
    settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache", poll_s=0.01)
    engine_settings = EngineSettings(max_batch_size=4)

    def build(name: str) -> ServingModel:
        engine = FakeEngine(engine_settings, context=16384)
        translator = Translator(
            FakeTokenizer(), "fake-model", engine.max_context_tokens, [], vocab_size=VOCAB
        )
        return ServingModel(name, engine, translator, embedder)

    async def main():
        store = await Store.open(settings.db_path)
        data_ = _file(3) if data is None else data
        rec = await batches.intake.submit(store, settings, data_, filename="e.jsonl", now=T0)
        opts = WorkerOptions(until_idle=True, engine=engine_settings)
        worker = Worker(store, settings, opts, clock=lambda: T0 + 1, engine_factory=build)
        await worker.run()
        rec = await store.get_batch(rec.id)
        out = await batches.files.file_content(store, rec.output_file_id)
        err = await batches.files.file_content(store, rec.error_file_id)
        await store.close()
        return (
            rec,
            [json.loads(x) for x in out.splitlines()],
            [json.loads(x) for x in err.splitlines()],
        )

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


def _lines(inputs: list) -> bytes:
    lines = [
        {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "default", "input": x}}
        for i, x in enumerate(inputs)
    ]  # fmt: skip
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def test_a_bad_line_gets_its_400_and_its_neighbours_run(tmp_path: Path) -> None:
    """Token ids past the vocabulary or past int32, an input over 8,192 tokens, a request over
    300,000 tokens: each line gets OpenAI's 400 in the error file; the good lines between them
    succeed (before: a segfault, or a 500 for the whole pass)."""
    long_input = [1] * 8193
    over_request = [[2] * 147] * 2048  # 301,056 tokens in 2,048 inputs of 147
    inputs = ["ab", [VOCAB], "cd", [2147483648], [-1], long_input, over_request, [[3, 4]]]
    rec, out, err = _run(tmp_path, FakeEmbedder(), _lines(inputs))
    assert rec.status is BatchStatus.COMPLETED
    assert sorted(o["custom_id"] for o in out) == ["e0", "e2", "e7"]
    errors = {e["custom_id"]: e["response"] for e in err}
    assert {k: v["status_code"] for k, v in errors.items()} == {
        f"e{i}": 400 for i in (1, 3, 4, 5, 6)
    }
    body = {k: v["body"]["error"] for k, v in errors.items()}
    assert body["e1"]["code"] == "invalid_value" and body["e1"]["param"] == "input"
    assert f"vocabulary has {VOCAB} tokens" in body["e1"]["message"]
    assert "32 bits" in body["e3"]["message"] and "2147483648" in body["e3"]["message"]
    assert body["e5"]["code"] == "context_length_exceeded"
    assert "8193 tokens" in body["e5"]["message"]
    assert body["e6"] == {
        "message": "Requested 301056 tokens, max 300000 tokens per request",
        "type": "max_tokens_per_request", "param": None, "code": "max_tokens_per_request",
    }  # fmt: skip


class SlicedEmbedder(FakeEmbedder):
    """Finishes one input per slice, as the real one does for long inputs."""

    def slices(self, inputs: Sequence[Sequence[int]]):
        vectors = self.embed(inputs)
        for i, v in enumerate(vectors):
            yield [(i, v)]


def test_each_run_is_one_slice_and_requests_end_as_they_finish() -> None:
    from batchmlx.core.records import ClaimedRequest
    from batchmlx.worker.embeddings import EmbeddingJobs

    tr = Translator(FakeTokenizer(), "fake-model", 64, [], vocab_size=VOCAB)
    jobs = EmbeddingJobs()
    for key, inputs in ((1, ["a"]), (2, ["b", "c", "d"])):
        body = {"model": "m", "input": inputs}
        c = ClaimedRequest(
            id=key, batch_id="b", custom_id=str(key), line=key, endpoint="/v1/embeddings",
            model=None, body=body, attempts=1,
        )  # fmt: skip
        assert jobs.add(c, tr, DIMS) is None
    emb = SlicedEmbedder()
    rounds = []
    while jobs:
        rounds.append([key for key, _ in jobs.run(emb, "m")])
    assert rounds == [[1], [], [], [2]]  # a request ends with its last input, not the wave's


def test_a_large_wave_ending_asks_for_its_memory_back(monkeypatch) -> None:
    """Only a large wave (LARGE_WAVE_TOKENS) ending sets the flag the worker releases memory
    on: a small request's wave does not empty MLX's cache under load."""
    from batchmlx.core.records import ClaimedRequest
    from batchmlx.worker import embeddings
    from batchmlx.worker.embeddings import EmbeddingJobs

    tr = Translator(FakeTokenizer(), "fake-model", 64, [], vocab_size=VOCAB)
    jobs = EmbeddingJobs()

    def wave(threshold: int) -> bool:
        monkeypatch.setattr(embeddings, "LARGE_WAVE_TOKENS", threshold)
        c = ClaimedRequest(
            id=1, batch_id="b", custom_id="1", line=1, endpoint="/v1/embeddings",
            model=None, body={"model": "m", "input": ["a", "b", "c"]}, attempts=1,
        )  # fmt: skip
        assert jobs.add(c, tr, DIMS) is None
        while jobs:
            jobs.run(SlicedEmbedder(), "m")
        ended, jobs.large_wave_ended = jobs.large_wave_ended, False
        return ended

    assert not wave(10_000)
    assert wave(3)
