from __future__ import annotations

import orjson
from openai.types import Batch, Completion
from openai.types.chat import ChatCompletion

from batchmlx.core.lifecycle import BatchStatus
from batchmlx.core.records import BatchErrorRecord, BatchRecord, BatchUsage, RequestCounts
from batchmlx.core.request import FinishReason
from batchmlx.formats.chat import chat_completion_body
from batchmlx.formats.completions import text_completion_body
from batchmlx.formats.errors import ErrorCode, errors_object
from batchmlx.formats.openai import (
    BATCH_CANCELLED_MESSAGE,
    BATCH_EXPIRED_MESSAGE,
    MIN_LOGPROB,
    ChoiceResult,
    IdPrefix,
    TokenLogprobText,
    batch_object,
    dumps_line,
    error_line,
    new_id,
    output_line,
)

LOGPROBS = [
    TokenLogprobText(
        "Hel", -0.25, [72, 101, 108], [("Hel", -0.25, [72, 101, 108]), ("Hi", -2.0, [72, 105])]
    ),
    TokenLogprobText("lo", -float("inf"), [108, 111], []),
]


def test_new_id():
    assert new_id(IdPrefix.BATCH, lambda: "abc") == "batch_abc"
    assert new_id("batch_req", lambda: "abc") == "batch_req_abc"
    assert new_id("file", lambda: "abc") == "file-abc"
    assert new_id(IdPrefix.CHAT_COMPLETION, lambda: "x") == "chatcmpl-x"
    assert new_id("cmpl-", lambda: "x") == "cmpl-x"
    a, b = new_id(IdPrefix.BATCH), new_id(IdPrefix.BATCH)
    assert a != b
    assert a.startswith("batch_")
    int(a.removeprefix("batch_"), 16)  # hex


def test_chat_completion_body_validates_with_sdk():
    body = chat_completion_body(
        id="chatcmpl-1",
        created=1700000000,
        model="m",
        choices=[
            ChoiceResult(0, "Hello", "stop", LOGPROBS),
            ChoiceResult(1, "Hi", FinishReason.LENGTH, None),
        ],
        prompt_tokens=10,
        completion_tokens=3,
        cached_tokens=4,
    )
    assert body == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello", "refusal": None},
                "logprobs": {
                    "content": [
                        {
                            "token": "Hel",
                            "logprob": -0.25,
                            "bytes": [72, 101, 108],
                            "top_logprobs": [
                                {"token": "Hel", "logprob": -0.25, "bytes": [72, 101, 108]},
                                {"token": "Hi", "logprob": -2.0, "bytes": [72, 105]},
                            ],
                        },
                        {
                            "token": "lo",
                            "logprob": MIN_LOGPROB,
                            "bytes": [108, 111],
                            "top_logprobs": [],
                        },
                    ],
                    "refusal": None,
                },
                "finish_reason": "stop",
            },
            {
                "index": 1,
                "message": {"role": "assistant", "content": "Hi", "refusal": None},
                "logprobs": None,
                "finish_reason": "length",
            },
        ],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 3,
            "total_tokens": 13,
            "prompt_tokens_details": {"cached_tokens": 4},
            "completion_tokens_details": {"reasoning_tokens": 0},
        },
        "system_fingerprint": None,
    }
    parsed = ChatCompletion.model_validate(orjson.loads(dumps_line(body)))
    assert parsed.choices[0].message.content == "Hello"
    assert parsed.choices[0].logprobs.content[0].top_logprobs[1].token == "Hi"
    assert parsed.usage.prompt_tokens_details.cached_tokens == 4
    assert parsed.usage.total_tokens == 13


def test_text_completion_body_validates_with_sdk():
    body = text_completion_body(
        id="cmpl-1",
        created=1,
        model="m",
        choices=[ChoiceResult(0, "Hello", "length", LOGPROBS)],
        prompt_tokens=2,
        completion_tokens=2,
        cached_tokens=0,
        text_offset=5,
    )
    assert body["object"] == "text_completion"
    assert body["choices"] == [
        {
            "index": 0,
            "text": "Hello",
            "logprobs": {
                "tokens": ["Hel", "lo"],
                "token_logprobs": [-0.25, MIN_LOGPROB],
                "top_logprobs": [{"Hel": -0.25, "Hi": -2.0}, {}],
                "text_offset": [5, 8],
            },
            "finish_reason": "length",
        }
    ]
    parsed = Completion.model_validate(orjson.loads(dumps_line(body)))
    assert parsed.choices[0].text == "Hello"
    assert parsed.choices[0].logprobs.text_offset == [5, 8]
    assert parsed.usage.completion_tokens == 2
    plain = text_completion_body(
        id="cmpl-2",
        created=1,
        model="m",
        choices=[ChoiceResult(0, "x", "stop")],
        prompt_tokens=1,
        completion_tokens=1,
        cached_tokens=1,
    )
    assert plain["choices"][0]["logprobs"] is None
    Completion.model_validate(plain)


def test_output_line():
    body = {"id": "chatcmpl-1"}
    line = output_line(
        id="batch_req_1", custom_id="c1", status_code=200, request_id="r1", body=body
    )
    assert line == {
        "id": "batch_req_1",
        "custom_id": "c1",
        "response": {"status_code": 200, "request_id": "r1", "body": body},
        "error": None,
    }


def test_error_lines():
    assert error_line(id="batch_req_1", custom_id="c", code="batch_expired", message="m") == {
        "id": "batch_req_1",
        "custom_id": "c",
        "response": None,
        "error": {"code": "batch_expired", "message": "m"},
    }
    assert BATCH_EXPIRED_MESSAGE == (
        "This request could not be executed before the completion window expired."
    )
    cancelled = error_line(
        id="i", custom_id="c", code=ErrorCode.BATCH_CANCELLED, message=BATCH_CANCELLED_MESSAGE
    )
    assert cancelled["error"] == {"code": "batch_cancelled", "message": BATCH_CANCELLED_MESSAGE}
    # the enum member serializes as its value
    assert dumps_line(cancelled).count(b'"batch_cancelled"') == 1


def test_dumps_line_is_deterministic_and_newline_terminated():
    obj = output_line(
        id="a", custom_id="é", status_code=200, request_id="r", body={"x": [1.5, None]}
    )
    first = dumps_line(obj)
    assert first == dumps_line(orjson.loads(first))
    assert first == dumps_line(dict(obj))
    assert first.endswith(b"}\n")
    assert first.count(b"\n") == 1
    assert first == (
        b'{"id":"a","custom_id":"\xc3\xa9","response":{"status_code":200,"request_id":"r",'
        b'"body":{"x":[1.5,null]}},"error":null}\n'
    )


def _record(**kw) -> BatchRecord:
    base = {
        "id": "batch_1",
        "endpoint": "/v1/chat/completions",
        "model": "m",
        "input_file_id": "file-1",
        "completion_window": "24h",
        "status": BatchStatus.IN_PROGRESS,
        "created_at": 100,
        "expires_at": 100 + 86400,
        "in_progress_at": 101,
    }
    return BatchRecord(**{**base, **kw})


def test_batch_object_round_trips_through_sdk():
    rec = _record(
        request_counts=RequestCounts(total=3, completed=2, failed=1),
        usage=BatchUsage(input_tokens=30, cached_tokens=10, output_tokens=7),
        metadata={"k": "v"},
        output_file_id="file-2",
    )
    obj = batch_object(rec)
    assert list(obj) == [
        "id", "object", "endpoint", "model", "errors", "input_file_id", "completion_window",
        "status", "output_file_id", "error_file_id", "created_at", "in_progress_at",
        "expires_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
        "cancelling_at", "cancelled_at", "request_counts", "metadata", "usage",
    ]  # fmt: skip
    assert obj["status"] == "in_progress"
    assert obj["errors"] is None
    assert obj["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    assert obj["usage"] == {
        "input_tokens": 30,
        "input_tokens_details": {"cached_tokens": 10},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 37,
    }
    batch = Batch.model_validate(orjson.loads(dumps_line(obj)))
    assert batch.model_dump(mode="json") == obj
    assert set(Batch.model_fields) == set(obj)


def test_failed_batch_object_with_errors():
    errors = (
        BatchErrorRecord("invalid_json_line", "Line 2 is not a valid JSON object.", 2),
        BatchErrorRecord("model_mismatch", "m", 3, "body.model"),
    )
    rec = _record(status=BatchStatus.FAILED, errors=errors, failed_at=102, in_progress_at=None)
    obj = batch_object(rec)
    assert obj["errors"] == errors_object(errors)
    assert obj["errors"] == {
        "object": "list",
        "data": [
            {
                "code": "invalid_json_line",
                "message": "Line 2 is not a valid JSON object.",
                "param": None,
                "line": 2,
            },
            {"code": "model_mismatch", "message": "m", "param": "body.model", "line": 3},
        ],
    }
    batch = Batch.model_validate(obj)
    assert batch.status == "failed"
    assert batch.errors.data[1].param == "body.model"
    assert batch.model_dump(mode="json") == obj


def test_every_status_validates():
    for status in BatchStatus:
        assert Batch.model_validate(batch_object(_record(status=status))).status == status.value
