"""OpenAI's recorded answers, over HTTP with the official client: llama-stack's
tests/integration/batches/test_batches_errors.py and test_batches.py record in comments what
OpenAI's Batch API answered; each test here quotes the case it follows. A `--no-worker` server:
every answer here is given at create or at validation, before any request would run."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.helpers import chat_body, request_line
from tests.server.helpers import jsonl, start_server, wait_batch, wait_validated

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    s = start_server(tmp_path_factory.mktemp("fidelity"), "--no-worker")
    yield s.client()
    s.stop()


def _upload(client, lines) -> str:
    return client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch").id


def _failed(client, lines, endpoint: str = CHAT):
    b = client.batches.create(
        input_file_id=_upload(client, lines), endpoint=endpoint, completion_window="24h"
    )
    b = wait_batch(client, b.id, timeout=30)
    assert b.status == "failed" and b.failed_at is not None, b
    return [(e.code, e.line, e.param, e.message) for e in b.errors.data]


def _error(exc: openai.APIStatusError) -> tuple[int, str | None, str | None, str]:
    e = exc.response.json()["error"]
    assert e["type"] == "invalid_request_error"
    return exc.status_code, e["code"], e["param"], e["message"]


def test_a_streaming_line_fails_the_file(client):
    """test_batch_mixed_streaming_requests: failed, one error: streaming_unsupported, line 2,
    param body.stream, 'Chat Completions: Streaming is not supported in the Batch API.'"""
    lines = [request_line("a", chat_body("hi")), request_line("b", chat_body("hi", stream=True))]
    assert _failed(client, lines) == [
        ("streaming_unsupported", 2, "body.stream",
         "Chat Completions: Streaming is not supported in the Batch API."),
    ]  # fmt: skip


def test_missing_envelope_keys(client):
    """test_batch_missing_required_fields: one missing_required_parameter a line."""
    lines = []
    for key in ("custom_id", "method", "url", "body"):
        line = request_line(f"no-{key}", chat_body("hi"))
        del line[key]
        lines.append(line)
    assert _failed(client, lines) == [
        ("missing_required_parameter", n, key, f"Missing required parameter: '{key}'.")
        for n, key in enumerate(("custom_id", "method", "url", "body"), 1)
    ]


def test_url_other_than_the_endpoint(client):
    """test_batch_endpoint_mismatch: an /v1/embeddings line (with a chat body) in a chat
    batch: one error, invalid_url at line 1, param url."""
    lines = [request_line("a", chat_body("hi"), url="/v1/embeddings")]
    assert _failed(client, lines) == [
        ("invalid_url", 1, "url",
         "The URL provided for this request does not match the batch endpoint."),
    ]  # fmt: skip
    # the batch's endpoint is /v1/completions; the file's chat lines all differ from it
    two = [request_line(f"r{i}", chat_body("hi")) for i in range(2)]
    assert [e[:3] for e in _failed(client, two, "/v1/completions")] == [
        ("invalid_url", 1, "url"), ("invalid_url", 2, "url")]  # fmt: skip


def test_missing_messages(client):
    """test_batch_missing_required_body_fields: invalid_request, param body.messages,
    'Messages parameter is required.'"""
    lines = [request_line("a", {"model": "gpt-4o-mini", "max_tokens": 10})]
    assert _failed(client, lines) == [
        ("invalid_request", 1, "body.messages", "Messages parameter is required.")
    ]


def test_a_malformed_message_is_a_per_line_error(client):
    """test_batch_e2e_chat_completions: a line with {"rolez", "contentz"} leaves the batch
    running (completed, 1 of 2 failed), not failed at validation."""
    bad = chat_body("x")
    bad["messages"] = [{"rolez": "user", "contentz": "This should fail"}]
    f = _upload(client, [request_line("ok", chat_body("hi")), request_line("bad", bad)])
    b = client.batches.create(input_file_id=f, endpoint=CHAT, completion_window="24h")
    b = wait_validated(client, b.id)
    assert b.status == "in_progress" and b.request_counts.total == 2, b
    assert client.batches.cancel(b.id).status == "cancelled"  # no worker: settled at once


def test_nonexistent_input_file(client):
    """test_batch_nonexistent_file_id: the create answers (validating); the batch then fails:
    invalid_request, line None, param file_id, 'Cannot find file ...'."""
    b = client.batches.create(
        input_file_id="file-nonexistent-xyz", endpoint=CHAT, completion_window="24h"
    )
    assert b.status == "validating"
    b = wait_batch(client, b.id, timeout=30)
    assert b.status == "failed" and b.failed_at is not None
    assert [(e.code, e.line, e.param, e.message) for e in b.errors.data] == [
        ("invalid_request", None, "file_id", "Cannot find file file-nonexistent-xyz.")
    ]


def test_unsupported_endpoint(client):
    """test_batch_invalid_endpoint: 400 invalid_value, param endpoint, 'Invalid value: ...
    Supported values are: ...'."""
    f = _upload(client, [request_line("a", chat_body("hi"))])
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(
            input_file_id=f, endpoint="/v1/invalid/endpoint", completion_window="24h"
        )
    assert _error(exc.value) == (
        400, "invalid_value", "endpoint",
        "Invalid value: '/v1/invalid/endpoint'. Supported values are: '/v1/chat/completions', "
        "'/v1/completions', '/v1/embeddings', and '/v1/responses'.",
    )  # fmt: skip


def test_metadata_of_the_wrong_type(client):
    """test_batch_invalid_metadata_types: 400 invalid_type, param metadata.tags, "Invalid type
    for 'metadata.tags': expected a string, but got an array instead."."""
    f = _upload(client, [request_line("a", chat_body("hi"))])
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(
            input_file_id=f, endpoint=CHAT, completion_window="24h",
            metadata={"tags": ["tag1", "tag2"]},  # type: ignore[dict-item]
        )  # fmt: skip
    assert _error(exc.value) == (
        400, "invalid_type", "metadata.tags",
        "Invalid type for 'metadata.tags': expected a string, but got an array instead.",
    )  # fmt: skip


def test_a_priority_in_metadata_is_validated_and_kept(client):
    """metadata.priority (lower runs first): an integer string from -100 to 100; else 400
    invalid_value naming metadata.priority."""
    f = _upload(client, [request_line("a", chat_body("hi"))])
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(
            input_file_id=f, endpoint=CHAT, completion_window="24h",
            metadata={"priority": "urgent"},
        )  # fmt: skip
    assert _error(exc.value) == (
        400, "invalid_value", "metadata.priority",
        "Invalid 'metadata.priority': expected an integer from -100 to 100 as a string (lower "
        "runs first), but got 'urgent' instead.",
    )  # fmt: skip
    batch = client.batches.create(
        input_file_id=f, endpoint=CHAT, completion_window="24h", metadata={"priority": "-2"}
    )
    assert client.batches.retrieve(batch.id).metadata == {"priority": "-2"}


def test_cancel_of_an_ended_batch_is_409(client):
    """test_batch_cancel_completed: 409, code and param null, "Cannot cancel a batch with
    status 'completed'."; 'Same for "failed", cancelling "cancelled" batches is allowed'."""
    bad = client.batches.create(
        input_file_id=_upload(client, ["not json"]), endpoint=CHAT, completion_window="24h"
    )
    assert wait_batch(client, bad.id, timeout=30).status == "failed"
    with pytest.raises(openai.ConflictError) as exc:
        client.batches.cancel(bad.id)
    assert _error(exc.value) == (409, None, None, "Cannot cancel a batch with status 'failed'.")
    good = client.batches.create(
        input_file_id=_upload(client, [request_line("a", chat_body("hi"))]), endpoint=CHAT,
        completion_window="24h",
    )  # fmt: skip
    assert client.batches.cancel(good.id).status == "cancelled"
    again = client.batches.cancel(good.id)  # allowed: the batch as it is
    assert (again.id, again.status) == (good.id, "cancelled")


@pytest.mark.parametrize("endpoint", [CHAT, "/v1/completions", "/v1/embeddings"])
def test_an_empty_file_keeps_the_endpoint_asked_for(client, endpoint):
    f = client.files.create(file=("empty.jsonl", b""), purpose="batch").id
    b = client.batches.create(input_file_id=f, endpoint=endpoint, completion_window="24h")
    b = wait_batch(client, b.id, timeout=30)
    assert (b.status, b.endpoint) == ("failed", endpoint)
    assert [e.code for e in b.errors.data] == ["empty_file"]
