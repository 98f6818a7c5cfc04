"""A batch's create request judged in OpenAI's words (formats.batch_request)."""

from __future__ import annotations

import pytest

from batchmlx.formats.batch_request import batch_priority, endpoint_problem, metadata_problem


def test_unsupported_endpoint_in_openais_words():
    """OpenAI (llama-stack tests/integration/batches test_batch_invalid_endpoint): 400
    invalid_value, param endpoint, the supported values listed."""
    p = endpoint_problem("/v1/invalid/endpoint")
    assert p is not None
    assert (p.code.value, p.param) == ("invalid_value", "endpoint")
    assert p.message == (
        "Invalid value: '/v1/invalid/endpoint'. Supported values are: '/v1/chat/completions', "
        "'/v1/completions', '/v1/embeddings', and '/v1/responses'."
    )
    for ok in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"):
        assert endpoint_problem(ok) is None


@pytest.mark.parametrize(
    ("metadata", "param", "message"),
    [
        ({"tags": ["tag1", "tag2"]}, "metadata.tags",
         "Invalid type for 'metadata.tags': expected a string, but got an array instead."),
        ({"a": "x", "n": 3}, "metadata.n",
         "Invalid type for 'metadata.n': expected a string, but got an integer instead."),
        ({"k": None}, "metadata.k",
         "Invalid type for 'metadata.k': expected a string, but got null instead."),
        ("text", "metadata",
         "Invalid type for 'metadata': expected an object, but got a string instead."),
    ],
)  # fmt: skip
def test_metadata_of_the_wrong_type_in_openais_words(metadata, param, message):
    """OpenAI (llama-stack test_batch_invalid_metadata_types): 400 invalid_type, param
    metadata.tags, "Invalid type for 'metadata.tags': expected a string, but got an array
    instead."."""
    p = metadata_problem(metadata)
    assert p is not None
    assert (p.code.value, p.param, p.message) == ("invalid_type", param, message)


def test_metadata_bounds():
    assert metadata_problem(None) is None and metadata_problem({}) is None
    assert metadata_problem({f"k{i}": "v" for i in range(16)}) is None
    assert metadata_problem({"k" * 64: "v" * 512}) is None
    many = metadata_problem({f"k{i}": "v" for i in range(17)})
    assert many is not None and (many.code.value, many.param) == ("invalid_value", "metadata")
    assert "at most 16 properties" in many.message
    long_key = metadata_problem({"k" * 65: "v"})
    assert long_key is not None and long_key.param == "metadata." + "k" * 65
    long_value = metadata_problem({"k": "v" * 513})
    assert long_value is not None and long_value.param == "metadata.k"
    assert "maximum length 512" in long_value.message


@pytest.mark.parametrize(
    "text", ["abc", "1.5", "", "101", "-101", "0x10", "1_0", "\u0661", "99999"]
)
def test_a_priority_that_is_no_integer_in_range_is_refused_naming_the_param(text):
    p = metadata_problem({"team": "x", "priority": text})
    assert p is not None
    assert (p.code.value, p.param) == ("invalid_value", "metadata.priority")
    assert p.message == (
        "Invalid 'metadata.priority': expected an integer from -100 to 100 as a string (lower "
        f"runs first), but got {text!r} instead."
    )


def test_a_batch_priority_is_read_from_its_metadata():
    for text, value in (("-5", -5), ("+3", 3), (" 10 ", 10), ("100", 100), ("-100", -100)):
        assert metadata_problem({"priority": text}) is None
        assert batch_priority({"priority": text}) == value
    assert batch_priority(None) == batch_priority({"team": "x"}) == 0
