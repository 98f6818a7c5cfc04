"""A real `batchmlx serve` (its worker, the real default model) fed the inputs that crashed it
or grew it without end: each gets a 400 for that request only, and the process lives on.

Before: `input: [1000000]` killed the server with a segmentation fault (`[49152]` gave an
all-zero vector), a line of `[2147483648]` failed its whole batch with 500s, and each distinct
4 MB schema added about 235 MB that was never freed."""

from __future__ import annotations

import json
import time

import pytest

from tests.e2e.helpers import request_line
from tests.server.helpers import jsonl, start_server, wait_batch

pytestmark = pytest.mark.real_model

VOCAB = 49152  # SmolLM2-135M's embedding rows


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("bounds"), "--max-batch-size", "4")
    yield s
    s.stop()


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    return server.raw("POST", path, data, {"Content-Type": "application/json"})


def _alive(server) -> None:
    assert server.proc.poll() is None, server.log.read_text()[-3000:]
    assert server.raw("GET", "/models")[0] == 200


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS"))


@pytest.mark.parametrize("ids", [[1_000_000], [VOCAB], [2_147_483_648], [5, -1]])
def test_embedding_token_ids_outside_the_vocabulary_are_a_400(server, ids):
    status, body = _post(server, "/embeddings", {"model": "m", "input": ids})
    _alive(server)
    assert status == 400, body
    assert body["error"]["param"] == "input" and body["error"]["code"] == "invalid_value"
    status, body = _post(server, "/embeddings", {"model": "m", "input": [VOCAB - 1, 3]})
    assert status == 200 and len(body["data"][0]["embedding"]) == 576


@pytest.mark.parametrize("ids", [[1_000_000], [VOCAB], [2_147_483_648]])
def test_completion_prompt_token_ids_outside_the_vocabulary_are_a_400(server, ids):
    status, body = _post(server, "/completions", {"model": "m", "prompt": ids, "max_tokens": 2})
    _alive(server)
    assert status == 400, body
    assert body["error"]["param"] == "prompt" and body["error"]["code"] == "invalid_value"


def test_embedding_token_caps_are_openais(server):
    status, body = _post(server, "/embeddings", {"model": "m", "input": [[7] * 147] * 2048})
    assert status == 400
    assert body["error"] == {
        "message": "Requested 301056 tokens, max 300000 tokens per request",
        "type": "max_tokens_per_request", "param": None, "code": "max_tokens_per_request",
    }  # fmt: skip
    status, body = _post(server, "/embeddings", {"model": "m", "input": [[7] * 8193]})
    assert status == 400 and body["error"]["code"] == "context_length_exceeded"
    status, body = _post(server, "/embeddings", {"model": "m", "input": [[7]] * 2049})
    assert status == 400 and body["error"]["param"] == "input"
    _alive(server)


def test_a_bad_embeddings_line_fails_alone(server):
    client = server.client(timeout=120)
    inputs = ["good one", [2_147_483_648], "good two", [1_000_000]]
    lines = [request_line(f"l{i}", {"model": "m", "input": x}, url="/v1/embeddings")
             for i, x in enumerate(inputs)]  # fmt: skip
    f = client.files.create(file=("e.jsonl", jsonl(lines)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                              completion_window="24h")  # fmt: skip
    b = wait_batch(client, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.completed, b.request_counts.failed) == (2, 2)
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    err = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == ["l0", "l2"]
    assert {e["custom_id"]: e["response"]["status_code"] for e in err} == {"l1": 400, "l3": 400}
    _alive(server)


def _chat_with_schema(schema: dict) -> dict:
    return {
        "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }  # fmt: skip


def test_huge_schemas_are_refused_and_memory_stays_flat(server):
    before = _rss(server.proc.pid)
    for i in range(3):  # each a distinct schema of about 2 MB
        props = {f"p{i}_{j:06d}": {"type": "string", "maxLength": 9} for j in range(50_000)}
        started = time.monotonic()
        schema = {"type": "object", "properties": props}
        status, body = _post(server, "/chat/completions", _chat_with_schema(schema))
        assert status == 400, body
        assert body["error"]["param"] == "response_format.json_schema.schema"
        assert "bytes are accepted" in body["error"]["message"]
        assert time.monotonic() - started < 30  # refused before any compile
    assert _rss(server.proc.pid) - before < 150 * 2**20
    _alive(server)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"},
])  # fmt: skip
def test_a_schema_with_no_finite_value_is_a_400(server, schema):
    status, body = _post(server, "/chat/completions", _chat_with_schema(schema))
    assert status == 400, body
    assert body["error"]["param"] == "response_format.json_schema.schema"
    assert "no finite JSON value" in body["error"]["message"]
