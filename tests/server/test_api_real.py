"""The official openai client against a real `batchmlx serve` with its worker and the real
default model: a batch end to end, cancel, and online completions streamed and not."""

from __future__ import annotations

import json

import pytest

from tests.e2e.helpers import chat_body, request_line
from tests.server.helpers import jsonl, start_server, wait_batch

pytestmark = pytest.mark.real_model

QUESTION = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # stream-interval 2: chunks carry two tokens, and must still join into the full text
    s = start_server(tmp_path_factory.mktemp("real"), "--stream-interval", "2",
                     "--max-batch-size", "8")  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client(timeout=120)


def test_batch_upload_run_download(client):
    lines = [request_line(f"ok-{i}", chat_body(f"Say {i}.", max_tokens=6, temperature=0))
             for i in range(3)]  # fmt: skip
    lines.append(request_line("too-hot", chat_body("Hi", max_tokens=6, temperature=7)))
    f = client.files.create(file=("batch.jsonl", jsonl(lines)), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert b.status == "validating"
    b = wait_batch(client, b.id)
    assert b.status == "completed", b
    c = b.request_counts
    assert (c.total, c.completed, c.failed) == (4, 3, 1)
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == ["ok-0", "ok-1", "ok-2"]
    for o in out:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["usage"]["completion_tokens"] <= 6
    (err,) = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert err["custom_id"] == "too-hot" and err["response"]["status_code"] == 400
    assert client.files.retrieve(b.output_file_id).purpose == "batch_output"


def test_cancel_a_running_batch(client):
    lines = [request_line(f"c{i}", chat_body(f"Count to {i}.", max_tokens=12)) for i in range(6)]
    f = client.files.create(file=("cancel.jsonl", jsonl(lines)), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    b = client.batches.cancel(b.id)
    assert b.status in ("cancelling", "cancelled")
    b = wait_batch(client, b.id, timeout=60)
    assert b.status == "cancelled" and b.request_counts.total == 6
    lines_out = []
    for fid in (b.output_file_id, b.error_file_id):
        if fid:
            lines_out += client.files.content(fid).text.splitlines()
    assert len(lines_out) == 6
    assert any("batch_cancelled" in x for x in lines_out)


def test_stream_joins_into_the_non_streamed_answer(client):
    whole = client.chat.completions.create(
        model="gpt-4o-mini", messages=QUESTION, max_tokens=12, temperature=0
    )
    chunks = list(client.chat.completions.create(
        model="gpt-4o-mini", messages=QUESTION, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_completions_stream_with_a_stop_string(client):
    args = dict(model="x", prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[" 7"])
    whole = client.completions.create(**args)
    streamed = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True))
    assert streamed == whole.choices[0].text
    assert " 7" not in streamed


def test_models_and_online_errors(client):
    import openai

    assert [m.id for m in client.models.list()] == ["SmolLM2-135M-Instruct"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="x", prompt="hi", logit_bias={"1": 5}, stream=True)
    assert exc.value.response.json()["error"]["param"] == "logit_bias"
