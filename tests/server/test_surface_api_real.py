"""The openai client against `batchmlx serve` for the rest of the batch surface: structured
chat, /v1/responses and /v1/embeddings, online and as batches."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai.types import CreateEmbeddingResponse
from openai.types.responses import Response

from tests.e2e.helpers import request_line
from tests.server.helpers import jsonl, start_server, wait_batch

pytestmark = pytest.mark.real_model

SCHEMA = {
    "type": "object",
    "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]},
                   "bright": {"type": "boolean"}},
    "required": ["colour", "bright"],
    "additionalProperties": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("surface"), "--max-batch-size", "8")
    yield s.client(timeout=180)
    s.stop()


def test_online_structured_chat_responses_and_embeddings(client):
    chat = client.chat.completions.create(
        model="gpt-4o-mini", messages=[{"role": "user", "content": "Pick a colour."}],
        max_tokens=32, temperature=0.9,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)

    r = client.responses.create(
        model="gpt-4o-mini", input="Pick a colour.", instructions="Answer in JSON.",
        max_output_tokens=32, store=False,
        text={"format": {"type": "json_schema", "name": "pick", "schema": SCHEMA}},
    )  # fmt: skip
    assert isinstance(r, Response) and r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0

    e = client.embeddings.create(model="text-embedding-3-small", input=["red", "blue"])
    assert isinstance(e, CreateEmbeddingResponse) and len(e.data) == 2
    assert len(e.data[0].embedding) == 576
    # the SDK asks for base64 by default and decodes it: the floats must survive
    short = client.embeddings.create(model="m", input="red", dimensions=32)
    assert len(short.data[0].embedding) == 32

    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="m", input="x", previous_response_id="resp_123")
    assert exc.value.response.json()["error"]["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {
                "name": "u", "schema": {"type": "array", "uniqueItems": True}}},
        )  # fmt: skip
    assert "uniqueItems" in exc.value.response.json()["error"]["message"]


@pytest.mark.parametrize("endpoint", ["/v1/responses", "/v1/embeddings"])
def test_batches_for_the_new_endpoints(client, endpoint):
    if endpoint == "/v1/responses":
        bodies = [{"model": "m", "input": f"Say {i}.", "max_output_tokens": 16} for i in range(3)]
    else:
        bodies = [{"model": "m", "input": [f"text {i}", "more"]} for i in range(3)]
    lines = [request_line(f"r{i}", b, url=endpoint) for i, b in enumerate(bodies)]
    f = client.files.create(file=("b.jsonl", jsonl(lines)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
    b = wait_batch(client, b.id)
    assert b.status == "completed" and b.request_counts.completed == 3, b
    assert b.model == "SmolLM2-135M-Instruct" and b.usage.input_tokens > 0
    for line in client.files.content(b.output_file_id).text.splitlines():
        body = json.loads(line)["response"]["body"]
        if endpoint == "/v1/responses":
            Response.model_validate(body)
        else:
            assert len(CreateEmbeddingResponse.model_validate(body).data) == 2
