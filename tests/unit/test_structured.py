"""response_format / text.format → the schema decoding is constrained to (pure)."""

from __future__ import annotations

import pytest

from batchmlx.formats.params import parse_request
from batchmlx.formats.request import ParsedRequest, RequestError
from batchmlx.formats.structured import (
    MAX_SCHEMA_BYTES,
    FormatError,
    FormatKind,
    admits_finite_value,
    canonical_schema,
    chat_grammar,
    responses_grammar,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**extra) -> ParsedRequest | RequestError:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    return parse_request("/v1/chat/completions", body)


def test_json_schema_becomes_a_canonical_grammar():
    spec = {"name": "thing", "schema": SCHEMA, "strict": True}
    fmt = {"type": "json_schema", "json_schema": spec}
    g = chat(response_format=fmt).grammar
    assert g.kind is FormatKind.JSON_SCHEMA and g.name == "thing"
    assert g.param == "response_format"
    # compact, in the order written: the answer's properties come in the schema's order
    assert g.schema == canonical_schema(SCHEMA)
    two = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    assert canonical_schema(two) == (
        '{"type":"object","properties":{"b":{"type":"integer"},"a":{"type":"integer"}}}'
    )


def test_json_object_and_text():
    g = chat(response_format={"type": "json_object"}).grammar
    assert g.kind is FormatKind.JSON_OBJECT and g.schema == '{"type":"object"}'
    assert chat(response_format={"type": "text"}).grammar is None
    assert chat().grammar is None


@pytest.mark.parametrize(
    ("fmt", "code", "param"),
    [
        ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "missing_required_parameter",
         "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}},
         "invalid_value", "response_format.json_schema.name"),
        ({"type": "json_schema", "json_schema": {"name": "a", "schema": []}}, "invalid_type",
         "response_format.json_schema.schema"),
        ({"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}, "invalid_type",
         "response_format.json_schema.strict"),
        ({"type": "json_schema"}, "missing_required_parameter", "response_format.json_schema"),
        ({"type": "yaml"}, "invalid_value", "response_format.type"),
    ],
)  # fmt: skip
def test_bad_response_formats_are_400s_naming_the_param(fmt, code, param):
    err = chat(response_format=fmt)
    assert isinstance(err, RequestError)
    assert (err.status_code, err.code, err.param) == (400, code, param)


def test_responses_text_format_is_flat():
    fmt = {"type": "json_schema", "name": "thing", "schema": SCHEMA}
    g = responses_grammar(fmt)
    assert g.param == "text.format" and g.name == "thing" and g.schema == canonical_schema(SCHEMA)
    with pytest.raises(FormatError) as exc:
        responses_grammar({"type": "json_schema", "schema": SCHEMA})
    assert exc.value.param == "text.format.name"
    assert chat_grammar(None) is None


SELF_REF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
DEFS_LOOP = {"$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}}, "$ref": "#/$defs/x"}
TREE = {  # recursive, but a node without children ends it
    "$defs": {"node": {"type": "object", "required": ["kids"], "properties": {
        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
    "$ref": "#/$defs/node",
}  # fmt: skip


@pytest.mark.parametrize("schema", [SELF_REF, DEFS_LOOP])
def test_a_schema_no_finite_value_satisfies_is_a_400(schema):
    """Before: accepted, and the answer was `{"` or `""` with finish_reason stop."""
    fmt = {"type": "json_schema", "json_schema": {"name": "loop", "schema": schema}}
    err = chat(response_format=fmt)
    assert isinstance(err, RequestError)
    assert (err.status_code, err.code) == (400, "invalid_value")
    assert err.param == "response_format.json_schema.schema"
    assert "no finite JSON value" in err.message
    err = parse_request("/v1/responses", {"model": "m", "input": "hi", "text": {
        "format": {"type": "json_schema", "name": "loop", "schema": schema}}})  # fmt: skip
    assert isinstance(err, RequestError) and err.param == "text.format.schema"


@pytest.mark.parametrize(
    ("schema", "finite"),
    [
        (SELF_REF, False), (DEFS_LOOP, False), (TREE, True), ({}, True), (True, True),
        (False, False), ({"enum": []}, False), ({"type": "object"}, True),
        ({"type": "object", "properties": {"a": {"$ref": "#"}}}, True),  # `a` may be left out
        ({"type": ["object", "null"], **{k: v for k, v in SELF_REF.items() if k != "type"}}, True),
        ({"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
          "required": ["a"]}, True),
        ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, False),
        ({"type": "array", "items": {"$ref": "#"}}, True),  # [] will do
        ({"type": "object", "required": ["a"], "additionalProperties": False}, False),
        ({"$ref": "#/$defs/elsewhere"}, True),  # not resolvable here: the compiler judges it
    ],
)  # fmt: skip
def test_admits_finite_value(schema, finite):
    assert admits_finite_value(schema) is finite


def test_a_schema_over_the_size_cap_is_a_400_naming_the_param():
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(20_000)}}
    assert len(canonical_schema(big)) > MAX_SCHEMA_BYTES
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": big}}
    err = chat(response_format=fmt)
    assert isinstance(err, RequestError)
    assert (err.status_code, err.code) == (400, "invalid_value")
    assert err.param == "response_format.json_schema.schema"
    assert f"at most {MAX_SCHEMA_BYTES} bytes" in err.message
