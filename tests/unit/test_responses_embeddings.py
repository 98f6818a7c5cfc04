"""/v1/responses and /v1/embeddings, the pure side: parsing, 400s, bodies the SDK types accept."""

from __future__ import annotations

import base64
import struct

import pytest
from openai.types import CreateEmbeddingResponse
from openai.types.responses import Response

from batchmlx.formats.embeddings import (
    EmbeddingsError,
    EncodingFormat,
    embeddings_body,
    parse_embeddings,
)
from batchmlx.formats.openai import ChoiceResult
from batchmlx.formats.params import parse_request
from batchmlx.formats.request import Endpoint, ParsedRequest, RequestError
from batchmlx.formats.responses import response_body
from batchmlx.formats.validate import MAX_TASKS, validate_batch_file

RESP = "/v1/responses"


def resp(**body) -> ParsedRequest | RequestError:
    return parse_request(RESP, {"model": "m", **body})


def test_responses_string_input_and_instructions():
    p = resp(input="Hi", instructions="Be brief.", max_output_tokens=20, temperature=0)
    assert p.endpoint is Endpoint.RESPONSES
    assert p.messages == ({"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Hi"})  # fmt: skip
    assert p.sampling.max_tokens == 20 and p.sampling.temperature == 0.0 and p.n == 1


def test_responses_message_items():
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Salut"}]},
        {"role": "user", "content": "Again"},
    ]
    p = resp(input=items, store=False, tools=[], tool_choice="auto", truncation="disabled")
    assert [m["role"] for m in p.messages] == ["system", "user", "assistant", "user"]
    assert p.messages[2]["content"] == "Salut"


def test_responses_text_format_is_a_grammar():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "obj", "schema": schema, "strict": True}
    p = resp(input="x", text={"format": fmt})
    assert p.grammar.param == "text.format" and p.grammar.name == "obj"
    assert resp(input="x", text={"format": {"type": "text"}}).grammar is None


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"input": "x", "store": True}, "unsupported_parameter", "store"),
        ({"input": "x", "previous_response_id": "resp_1"}, "unsupported_parameter",
         "previous_response_id"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "unsupported_parameter", "tools"),
        ({"input": "x", "conversation": "conv_1"}, "unsupported_parameter", "conversation"),
        ({"input": "x", "background": True}, "unsupported_parameter", "background"),
        ({"input": "x", "max_output_tokens": 8}, "invalid_value", "max_output_tokens"),
        ({"input": "x", "temperature": 3}, "invalid_value", "temperature"),
        ({"input": "x", "bogus": 1}, "unknown_parameter", "bogus"),
        ({}, "missing_required_parameter", "input"),
        ({"input": [{"type": "function_call_output", "output": "1"}]}, "unsupported_parameter",
         "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "invalid_value", "input[0].content[0].image_url"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "unsupported_parameter", "input[0].content[0].type"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
         "missing_required_parameter", "text.format.name"),
    ],
)  # fmt: skip
def test_responses_refusals_name_the_param(body, code, param):
    err = resp(**body)
    assert isinstance(err, RequestError), err
    assert (err.status_code, err.code, err.param) == (400, code, param)
    if code == "unsupported_parameter":
        assert err.message.startswith(f"Unsupported parameter: '{param}' is not supported")


def test_response_body_validates_with_the_sdk_types():
    request = {"model": "m", "input": "x", "instructions": "Be brief.", "max_output_tokens": 16,
               "temperature": 0.5, "metadata": {"k": "v"}}  # fmt: skip
    for finish, status in (("stop", "completed"), ("length", "incomplete")):
        body = response_body(
            id="resp_1", message_id="msg_1", created=7, model="SmolLM2", request=request,
            choice=ChoiceResult(0, "Hello", finish), input_tokens=9, output_tokens=3,
            cached_tokens=4,
        )  # fmt: skip
        r = Response.model_validate(body)
        assert r.object == "response" and r.status == status and r.output_text == "Hello"
        assert r.usage.input_tokens == 9 and r.usage.input_tokens_details.cached_tokens == 4
        assert r.usage.total_tokens == 12 and r.instructions == "Be brief."
        assert (r.incomplete_details is not None) == (finish == "length")


def test_embeddings_inputs():
    assert parse_embeddings({"input": "a"}).texts == ("a",)
    assert parse_embeddings({"input": ["a", "b"]}).count == 2
    assert parse_embeddings({"input": [1, 2, 3]}).token_ids == ((1, 2, 3),)
    r = parse_embeddings({"input": [[1], [2, 3]], "encoding_format": "base64", "dimensions": 8})
    assert r.token_ids == ((1,), (2, 3)) and r.encoding is EncodingFormat.BASE64
    assert r.dimensions == 8


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({}, "missing_required_parameter", "input"),
        ({"input": ""}, "invalid_value", "input"),
        ({"input": [1, "a"]}, "invalid_type", "input"),
        ({"input": "a", "encoding_format": "int8"}, "invalid_value", "encoding_format"),
        ({"input": "a", "dimensions": 0}, "invalid_value", "dimensions"),
        ({"input": "a", "temperature": 0}, "unknown_parameter", "temperature"),
        ({"input": ["a"] * 2049}, "invalid_value", "input"),
    ],
)
def test_embeddings_refusals(body, code, param):
    with pytest.raises(EmbeddingsError) as exc:
        parse_embeddings(body)
    assert (exc.value.code.value, exc.value.param) == (code, param)


def test_embeddings_body_float_and_base64():
    vecs = [[0.6, 0.8], [1.0, 0.0]]
    body = embeddings_body(vectors=vecs, model="m", prompt_tokens=5, encoding=EncodingFormat.FLOAT)
    r = CreateEmbeddingResponse.model_validate(body)
    assert [d.embedding for d in r.data] == vecs and r.usage.total_tokens == 5
    b64 = embeddings_body(vectors=vecs, model="m", prompt_tokens=5,
                          encoding=EncodingFormat.BASE64)  # fmt: skip
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert struct.unpack("<2f", raw) == pytest.approx((0.6, 0.8))


def _line(i: int, url: str, body: dict) -> bytes:
    import orjson

    return orjson.dumps({"custom_id": f"c{i}", "method": "POST", "url": url, "body": body}) + b"\n"


def test_files_for_the_new_urls_validate():
    data = b"".join(_line(i, RESP, {"model": "m", "input": "hi"}) for i in range(3))
    r = validate_batch_file(data)
    assert r.ok and r.endpoint == RESP
    bad = _line(1, RESP, {"model": "m"})
    assert [(e.code, e.param) for e in validate_batch_file(bad).errors] == [
        ("invalid_request", "body.input")
    ]
    emb = b"".join(_line(i, "/v1/embeddings", {"model": "m", "input": ["a", "b"]})
                   for i in range(3))  # fmt: skip
    assert validate_batch_file(emb).ok


def test_embedding_inputs_capped_at_50000_across_the_batch():
    body = {"model": "m", "input": ["x"] * 2000}
    under = b"".join(_line(i, "/v1/embeddings", body) for i in range(25))  # 50,000 exactly
    assert validate_batch_file(under).ok
    over = under + _line(99, "/v1/embeddings", {"model": "m", "input": "one more"})
    errors = validate_batch_file(over).errors
    assert [e.code for e in errors] == ["too_many_embedding_inputs"]
    assert "50000" in errors[0].message and MAX_TASKS == 50_000
