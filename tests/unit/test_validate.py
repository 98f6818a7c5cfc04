from __future__ import annotations

import json

import orjson
import pytest

from batchmlx.core.model_rule import Chosen, Refused, Via, Why
from batchmlx.formats.errors import ErrorCode
from batchmlx.formats.params import parse_request
from batchmlx.formats.request import RequestError
from batchmlx.formats.validate import (
    MAX_FILE_BYTES,
    MAX_NESTING,
    MAX_REPORTED_ERRORS,
    MAX_TASKS,
    SUPPORTED_URLS,
    BatchLine,
    FileValidator,
    LineSplitter,
    _split_lines,
    validate_batch_file,
)

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


def chat(cid: str, model: str = "m", content="hi", **body) -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": CHAT,
        "body": {"model": model, "messages": [{"role": "user", "content": content}], **body},
    }


def compl(cid: str, prompt="hi", model: str = "m") -> dict:
    return {
        "custom_id": cid,
        "method": "POST",
        "url": COMPL,
        "body": {"model": model, "prompt": prompt},
    }


def jsonl(*items, sep: bytes = b"\n", final: bool = True) -> bytes:
    lines = [item if isinstance(item, bytes) else orjson.dumps(item) for item in items]
    return sep.join(lines) + (sep if final else b"")


def codes(result) -> list[tuple[str, int | None, str | None]]:
    return [(e.code, e.line, e.param) for e in result.errors]


def test_good_file():
    r = validate_batch_file(jsonl(chat("a"), chat("b")))
    assert r.ok
    assert r.errors == ()
    assert r.endpoint == CHAT
    assert r.model == "m"
    assert r.lines == (
        BatchLine(1, "a", CHAT, orjson.dumps(chat("a")["body"]).decode()),
        BatchLine(2, "b", CHAT, orjson.dumps(chat("b")["body"]).decode()),
    )
    assert r.lines[0].body == chat("a")["body"]


def test_completions_prompt_forms_accepted():
    prompts = ["x", "", ["x"], ["x", "y"], [1, 2, 3], [[1, 2]]]
    r = validate_batch_file(jsonl(*(compl(str(i), p) for i, p in enumerate(prompts))))
    assert r.ok, r.errors
    assert r.endpoint == COMPL
    assert len(r.lines) == len(prompts)


def test_odd_parameter_values_are_not_rejected_here():
    item = chat("a", temperature=7, stream=False, foo=1, tools=[{}])
    assert validate_batch_file(jsonl(item)).ok


@pytest.mark.parametrize(
    ("item", "name"),
    [
        (chat("b", stream=True), "Chat Completions"),
        ({**compl("b"), "body": {"model": "m", "prompt": "x", "stream": True}}, "Completions"),
        (
            {"custom_id": "b", "method": "POST", "url": "/v1/responses",
             "body": {"model": "m", "input": "x", "stream": True}},
            "Responses",
        ),
    ],
)  # fmt: skip
def test_stream_true_fails_the_file_naming_its_line(item, name):
    """OpenAI (llama-stack tests/integration/batches, test_batch_mixed_streaming_requests): the
    batch fails with one error, streaming_unsupported at line 2, param body.stream."""
    first = {**item, "custom_id": "a", "body": {**item["body"], "stream": False}}
    r = validate_batch_file(jsonl(first, item))
    assert codes(r) == [("streaming_unsupported", 2, "body.stream")]
    assert r.errors[0].message == f"{name}: Streaming is not supported in the Batch API."
    assert r.lines == (BatchLine(1, "a", first["url"], orjson.dumps(first["body"]).decode()),)


def test_stream_on_embeddings_is_not_a_file_error():
    item = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
            "body": {"model": "m", "input": "x", "stream": True}}  # fmt: skip
    assert validate_batch_file(jsonl(item)).ok  # an unknown key there: that line's own 400


def test_bom_crlf_and_missing_final_newline():
    data = b"\xef\xbb\xbf" + jsonl(chat("a"), chat("b"), sep=b"\r\n", final=False)
    r = validate_batch_file(data)
    assert r.ok
    assert [ln.line for ln in r.lines] == [1, 2]


def test_blank_lines_skipped_but_counted():
    data = b"\n  \n" + orjson.dumps(chat("a")) + b"\n\t\r\n" + orjson.dumps(chat("a"))
    r = validate_batch_file(data)
    assert codes(r) == [("duplicate_custom_id", 5, "custom_id")]
    assert [ln.line for ln in r.lines] == [3]


def test_file_too_large():
    data = jsonl(chat("a"))
    r = validate_batch_file(data, max_bytes=len(data) - 1)
    assert codes(r) == [("file_too_large", None, None)]
    assert r.lines == ()
    assert not r.ok
    assert validate_batch_file(data, max_bytes=len(data)).ok
    assert MAX_FILE_BYTES == 200 * 1024 * 1024


@pytest.mark.parametrize("data", [b"", b"\n\n", b"  \r\n", b"\xef\xbb\xbf"])
def test_empty_file(data):
    r = validate_batch_file(data)
    assert codes(r) == [("empty_file", None, None)]
    assert not r.ok


def test_too_many_tasks_reported_once_at_first_line_past_limit():
    data = jsonl(chat("a"), b"", chat("b"), chat("c"), chat("d"))
    r = validate_batch_file(data, max_tasks=2)
    assert codes(r) == [("too_many_tasks", 4, None)]
    assert MAX_TASKS == 50_000
    assert validate_batch_file(jsonl(chat("a"), chat("b")), max_tasks=2).ok


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b'"str"', b"42", b"null", b"{} {}"])
def test_invalid_json_line(raw):
    r = validate_batch_file(jsonl(chat("a"), raw))
    assert codes(r) == [("invalid_json_line", 2, None)]
    assert r.errors[0].message == "Line 2 is not a valid JSON object."
    assert [ln.line for ln in r.lines] == [1]


def test_binary_garbage_and_bad_utf8_are_invalid_json_lines():
    bad_utf8 = b'{"custom_id": "\xff\xfe", "method": "POST"}'
    r = validate_batch_file(jsonl(b"\x00\x01\x89PNG\x1a", bad_utf8, chat("a")))
    assert codes(r) == [("invalid_json_line", 1, None), ("invalid_json_line", 2, None)]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"custom_id": ""}, "custom_id"),
        ({"custom_id": 7}, "custom_id"),
        ({"method": "GET"}, "method"),
        ({"url": 3}, "url"),
        ({"body": "text"}, "body"),
        ({"extra": 1}, "extra"),
    ],
)
def test_invalid_envelope(change, param):
    item = {**chat("a"), **change}
    r = validate_batch_file(jsonl(chat("z"), item))
    assert codes(r) == [("invalid_request", 2, param)]
    assert r.errors[0].message.startswith("Line 2: ")


def test_missing_envelope_keys_in_openais_words():
    """OpenAI (llama-stack test_batch_missing_required_fields): one error a line, each
    missing_required_parameter naming the key, e.g. "Missing required parameter: 'custom_id'."."""
    items = []
    for key in ("custom_id", "method", "url", "body"):
        item = chat(f"no-{key}")
        del item[key]
        items.append(item)
    items.append({**chat("null-body"), "body": None})  # null is absent, as OpenAI reads it
    r = validate_batch_file(jsonl(*items))
    keys = ["custom_id", "method", "url", "body", "body"]
    assert codes(r) == [("missing_required_parameter", n, k) for n, k in enumerate(keys, 1)]
    assert [e.message for e in r.errors] == [f"Missing required parameter: '{k}'." for k in keys]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "body.model"),
        ({"model": "", "messages": [{"role": "user", "content": "x"}]}, "body.model"),
        ({"model": 3, "messages": [{"role": "user", "content": "x"}]}, "body.model"),
        ({"model": "m"}, "body.messages"),
        ({"model": "m", "messages": "hi"}, "body.messages"),
        ({"model": "m", "messages": {"role": "user"}}, "body.messages"),
    ],
)
def test_invalid_chat_body(body, param):
    item = {"custom_id": "a", "method": "POST", "url": CHAT, "body": body}
    r = validate_batch_file(jsonl(item))
    assert codes(r) == [("invalid_request", 1, param)]


def test_missing_messages_in_openais_words():
    """OpenAI (llama-stack test_batch_missing_required_body_fields): invalid_request at the
    line, param body.messages, "Messages parameter is required."."""
    item = {"custom_id": "a", "method": "POST", "url": CHAT, "body": {"model": "m"}}
    r = validate_batch_file(jsonl(chat("z"), item))
    assert codes(r) == [("invalid_request", 2, "body.messages")]
    assert r.errors[0].message == "Messages parameter is required."


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], "messages[1].role"),
        ([{"rolez": "user", "contentz": "This should fail"}], "messages[0].role"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": ["x"], "content": "x"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "assistant"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "user", "content": ["x"]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"text": "x"}]}], "messages[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
    ],
)
def test_malformed_messages_are_that_lines_400_not_a_failed_file(messages, param):
    """OpenAI (llama-stack test_batch_e2e_chat_completions): a line whose message has "rolez"
    and "contentz" leaves the batch `completed` with that line failed: the file passes, the
    line's body is refused when it runs."""
    item = {"custom_id": "a", "method": "POST", "url": CHAT,
            "body": {"model": "m", "messages": messages}}  # fmt: skip
    r = validate_batch_file(jsonl(chat("z"), item))
    assert r.ok, r.errors
    refused = parse_request(CHAT, r.lines[1].body)
    assert isinstance(refused, RequestError), refused
    assert (refused.status_code, refused.param) == (400, param)


def test_chat_content_forms_accepted():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "developer", "content": "d"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]},
        {"role": "tool", "content": "t", "tool_call_id": "x"},
    ]
    item = {
        "custom_id": "a",
        "method": "POST",
        "url": CHAT,
        "body": {"model": "m", "messages": messages},
    }
    assert validate_batch_file(jsonl(item)).ok


@pytest.mark.parametrize("prompt", [None, 3, [], [None], ["a", 1], [[]], {"a": 1}, [True]])
def test_invalid_completions_prompt(prompt):
    item = compl("a", prompt)
    if prompt is None:
        del item["body"]["prompt"]
    r = validate_batch_file(jsonl(item))
    assert codes(r) == [("invalid_request", 1, "body.prompt")]


def test_invalid_url():
    item = {**chat("a"), "url": "/v1/images/generations"}
    # first (no endpoint named, none seen yet): a url batchmlx does not serve
    r = validate_batch_file(jsonl(item, chat("z")))
    assert codes(r) == [("invalid_url", 1, "url")]
    msg = r.errors[0].message
    assert "'/v1/images/generations'" in msg
    assert all(url in msg for url in SUPPORTED_URLS)
    # later: it is not the batch's endpoint
    r = validate_batch_file(jsonl(chat("z"), item))
    assert codes(r) == [("invalid_url", 2, "url")]
    assert r.errors[0].message == MISMATCH


MISMATCH = "The URL provided for this request does not match the batch endpoint."


def test_url_mismatch_on_each_differing_line():
    r = validate_batch_file(jsonl(compl("a"), chat("b"), compl("c"), chat("d")))
    assert codes(r) == [("invalid_url", 2, "url"), ("invalid_url", 4, "url")]
    assert [e.message for e in r.errors] == [MISMATCH, MISMATCH]
    assert r.endpoint == COMPL
    assert [ln.line for ln in r.lines] == [1, 3]


def test_url_mismatch_counts_from_first_valid_url():
    bad = {**chat("a"), "url": "/v1/nope"}
    r = validate_batch_file(jsonl(bad, chat("b"), compl("c")))
    assert codes(r) == [("invalid_url", 1, "url"), ("invalid_url", 3, "url")]
    assert r.errors[1].message == MISMATCH
    assert r.endpoint == CHAT


def test_url_other_than_the_batch_endpoint_is_invalid_url_at_its_line():
    """OpenAI (llama-stack test_batch_endpoint_mismatch): a chat batch with an /v1/embeddings
    line fails with one error, invalid_url at line 1; its chat-shaped body is not judged."""
    item = {**chat("a"), "url": "/v1/embeddings"}
    r = validate_batch_file(jsonl(item, chat("b"), compl("c")), endpoint=CHAT)
    assert codes(r) == [("invalid_url", 1, "url"), ("invalid_url", 3, "url")]
    assert [e.message for e in r.errors] == [MISMATCH, MISMATCH]
    assert r.endpoint == CHAT
    # the batch's endpoint wins over the first line's
    r = validate_batch_file(jsonl(compl("a"), chat("b")), endpoint=CHAT)
    assert codes(r) == [("invalid_url", 1, "url")]


def test_model_mismatch_on_each_differing_line():
    r = validate_batch_file(jsonl(chat("a", "x"), chat("b", "y"), chat("c", "x"), chat("d", "z")))
    assert codes(r) == [("model_mismatch", 2, "body.model"), ("model_mismatch", 4, "body.model")]
    assert r.model == "x"


def test_duplicate_custom_id_on_second_and_later():
    r = validate_batch_file(jsonl(chat("a"), chat("b"), chat("a"), chat("a")))
    assert codes(r) == [
        ("duplicate_custom_id", 3, "custom_id"),
        ("duplicate_custom_id", 4, "custom_id"),
    ]
    assert "line 1" in r.errors[0].message
    assert "line 1" in r.errors[1].message


def _refuse(name: str) -> Refused:
    return Refused(f"no {name!r}", Why.UNKNOWN)


def _serve_local(name: str) -> Chosen:
    return Chosen("local", Via.FALLBACK)


def test_model_not_found_once_at_first_use():
    asked: list[str] = []

    def refuse(name: str) -> Refused:
        asked.append(name)
        return _refuse(name)

    data = jsonl(b"", chat("a", "ghost"), chat("b", "ghost"))
    r = validate_batch_file(data, model_choice=refuse)
    assert codes(r) == [("model_not_found", 2, "body.model")]
    assert r.errors[0].message == "no 'ghost'"
    assert asked == ["ghost"]
    chosen = validate_batch_file(data, model_choice=_serve_local)
    assert chosen.ok and chosen.model == "local"  # the model chosen, not the name asked


def test_override_ignores_body_models():
    data = jsonl(chat("a", "gpt-4o-mini"), chat("b", "gpt-4o"), chat("c", ""))
    r = validate_batch_file(data, model_override="local", model_choice=_refuse)
    assert r.ok, r.errors
    assert r.model == "local"
    plain = validate_batch_file(data, model_choice=_refuse)
    assert [e.code for e in plain.errors] == [
        "model_not_found",
        "model_mismatch",
        "invalid_request",
    ]


def test_all_errors_reported_in_line_order():
    data = jsonl(
        chat("a"),
        b"oops",
        {**chat("b"), "method": "GET", "extra": 1},
        chat("a", "other"),
        compl("c"),
        {**chat("d"), "url": "/v1/x"},
    )
    r = validate_batch_file(data)
    assert codes(r) == [
        ("invalid_json_line", 2, None),
        ("invalid_request", 3, "method"),
        ("invalid_request", 3, "extra"),
        ("duplicate_custom_id", 4, "custom_id"),
        ("model_mismatch", 4, "body.model"),
        ("invalid_url", 5, "url"),
        ("invalid_url", 6, "url"),
    ]
    assert not r.ok
    assert [ln.line for ln in r.lines] == [1]


def test_every_file_code_is_produced():
    produced = {
        "file_too_large",
        "empty_file",
        "too_many_tasks",
        "invalid_json_line",
        "invalid_request",
        "invalid_url",
        "streaming_unsupported",
        "missing_required_parameter",
        "model_mismatch",
        "duplicate_custom_id",
        "model_not_found",
        "too_many_errors",
    }
    assert produced <= {c.value for c in ErrorCode}


def test_line_of_several_megabytes():
    big = "word " * 1_000_000  # 5 MB of content
    r = validate_batch_file(jsonl(chat("a", content=big), chat("b")))
    assert r.ok
    assert r.lines[0].body["messages"][0]["content"] == big


def test_errors_are_bounded_and_counted():
    # 300,001 lines of garbage: the first errors are listed, then one item with the total
    r = validate_batch_file(b"x\n" * 300_001)
    assert r.error_count == 300_001 + 1  # and too_many_tasks, at line 50,001
    assert len(r.errors) == MAX_REPORTED_ERRORS + 1
    assert [e.line for e in r.errors[:-1]] == list(range(1, MAX_REPORTED_ERRORS + 1))
    assert {e.code for e in r.errors[:-1]} == {"invalid_json_line"}
    last = r.errors[-1]
    assert (last.code, last.line) == ("too_many_errors", None)
    assert "299,902 more errors (300,002 in all)" in last.message


def test_errors_up_to_the_bound_are_listed_without_a_summary():
    r = validate_batch_file(b"x\n" * 3, max_errors=3)
    assert codes(r) == [("invalid_json_line", n, None) for n in (1, 2, 3)]
    assert r.error_count == 3


def test_file_level_error_found_last_is_listed_past_the_bound():
    lines = [chat("a", model="nope")] + [b"x"] * 5
    r = validate_batch_file(jsonl(*lines), model_choice=_refuse, max_errors=2)
    # model_not_found (line 1) is found after every line error, and still listed first
    assert codes(r) == [
        ("model_not_found", 1, "body.model"),
        ("invalid_json_line", 2, None),
        ("too_many_errors", None, None),
    ]
    assert r.error_count == 6


def _nested(depth: int) -> list:
    return orjson.loads(b"[" * depth + b"]" * depth)


def test_body_nested_deeper_than_orjson_writes_is_refused():
    deep = chat("deep", response_format={"x": _nested(MAX_NESTING + 10)})
    ok = chat("ok", response_format={"x": _nested(MAX_NESTING - 10)})
    r = validate_batch_file(jsonl(ok, json.dumps(deep).encode()))  # orjson cannot write it
    assert codes(r) == [("invalid_json_line", 2, "body")]
    assert "Line 2" in r.errors[0].message and "nested too deeply" in r.errors[0].message
    assert [ln.line for ln in r.lines] == [1]
    # what validation accepts, the store can write: it keeps the encoded body
    assert orjson.loads(r.lines[0].body_json) == ok["body"]


def test_bom_and_no_final_newline_with_streamed_lines():
    r = validate_batch_file(b"\xef\xbb\xbf" + jsonl(chat("a"), b"", chat("b"), final=False))
    assert r.ok and [ln.line for ln in r.lines] == [1, 3]


def _streamed(data: bytes, step: int, **kw):
    """`data` through LineSplitter and FileValidator in chunks of `step` bytes."""
    splitter, v, good = LineSplitter(), FileValidator(**kw), []
    for i in range(0, len(data), step):
        good += [g for n, raw in splitter.feed(data[i : i + step]) if (g := v.check(n, raw))]
    good += [g for n, raw in splitter.end() if (g := v.check(n, raw))]
    return good, v.finish()


@pytest.mark.parametrize("step", [1, 2, 3, 7, 64, 10_000])
def test_streamed_validation_is_whole_file_validation_whatever_the_chunks(step):
    data = b"\xef\xbb\xbf" + jsonl(chat("a"), b"", b"oops", chat("a"), compl("c"), b"\r",
                                     chat("d"), final=False)  # fmt: skip
    whole = validate_batch_file(data)
    good, result = _streamed(data, step)
    assert tuple(good) == whole.lines
    assert (result.errors, result.endpoint, result.model, result.error_count) == (
        whole.errors, whole.endpoint, whole.model, whole.error_count)  # fmt: skip
    ok_data = jsonl(chat("a"), chat("b"))
    good, result = _streamed(ok_data, step)
    assert [g.custom_id for g in good] == ["a", "b"] and not result.errors


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_line_splitter_numbers_lines_as_the_whole_file_does(step):
    data = b"\xef\xbb\xbfab\n\ncd\r\n\nef"
    splitter, lines = LineSplitter(), []
    for i in range(0, len(data), step):
        lines += splitter.feed(data[i : i + step])
    lines += splitter.end()
    assert lines == list(_split_lines(data, 3)) == [
        (1, b"ab"), (2, b""), (3, b"cd\r"), (4, b""), (5, b"ef")]  # fmt: skip
