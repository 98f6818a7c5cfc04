"""response_format / text.format → the schema decoding is constrained to (pure)."""

from __future__ import annotations

import pytest

from batchmlx.formats.params import parse_request
from batchmlx.formats.request import ParsedRequest, RequestError
from batchmlx.formats.structured import (
    FormatError,
    FormatKind,
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
    # key order and spacing do not matter: equal schemas share one compiled grammar
    reordered = {"required": ["a"], "properties": {"a": {"type": "integer"}}, "type": "object"}
    assert g.schema == canonical_schema(reordered)
    assert g.schema == '{"properties":{"a":{"type":"integer"}},"required":["a"],"type":"object"}'


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
