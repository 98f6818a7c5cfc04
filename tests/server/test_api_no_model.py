"""The HTTP API without the model: a `--no-worker` server with an API key and a 1 MB upload
limit. Files, batch validation after create, cancel, pagination, auth and error envelopes."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from tests.e2e.helpers import chat_body, cli_env, request_line
from tests.server.helpers import jsonl, start_server, wait_batch

KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = start_server(
        tmp_path_factory.mktemp("api"), "--no-worker", "--max-upload-mb", "1", api_key=KEY
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def good_file(n: int = 2) -> bytes:
    return jsonl([request_line(f"r{i}", chat_body(f"q{i}", max_tokens=4)) for i in range(n)])


def _envelope(err: openai.APIStatusError) -> dict:
    body = err.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_wrong_or_missing_key_is_401(server):
    with pytest.raises(openai.AuthenticationError) as exc:
        server.client(api_key="sk-wrong").models.list()
    assert _envelope(exc.value)["code"] == "invalid_api_key"
    status, body = server.raw("GET", "/models", headers={"Authorization": ""})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert server.client().models.list().data[0].id == "SmolLM2-135M-Instruct"


def test_bearer_scheme_is_case_insensitive(server):
    for scheme in ("bearer", "BEARER", "Bearer"):
        status, body = server.raw("GET", "/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert status == 200 and body["object"] == "list", (scheme, body)
    status, body = server.raw("GET", "/models", headers={"Authorization": f"Basic {KEY}"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"


def test_upload_retrieve_list_content_delete(client):
    data = good_file()
    f = client.files.create(file=("in.jsonl", data), purpose="batch")
    assert (f.object, f.purpose, f.bytes, f.filename) == ("file", "batch", len(data), "in.jsonl")
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == data
    assert f.id in [x.id for x in client.files.list(purpose="batch")]
    assert f.id not in [x.id for x in client.files.list(purpose="batch_output")]
    deleted = client.files.delete(f.id)
    assert (deleted.id, deleted.deleted) == (f.id, True)
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_files_pagination_and_order(client):
    ids = [client.files.create(file=(f"p{i}.jsonl", good_file()), purpose="batch").id
           for i in range(3)]  # fmt: skip
    page = client.files.list(limit=2, order="asc")
    assert len(page.data) == 2 and page.has_more
    asc = [f.id for f in client.files.list(limit=1, order="asc")]  # follows the cursor
    desc = [f.id for f in client.files.list(limit=2, order="desc")]
    assert asc == desc[::-1]
    assert [i for i in asc if i in ids] == ids


def test_unknown_ids_are_404(client, server):
    for call in (
        lambda: client.files.retrieve("file-nope"),
        lambda: client.files.content("file-nope"),
        lambda: client.files.delete("file-nope"),
        lambda: client.batches.retrieve("batch_nope"),
        lambda: client.batches.cancel("batch_nope"),
    ):
        with pytest.raises(openai.NotFoundError) as exc:
            call()
        assert _envelope(exc.value)["code"] == "not_found"
    status, body = server.raw("GET", "/nothing-here")
    assert status == 404 and body["error"]["type"] == "invalid_request_error"


def test_bad_multipart_and_missing_fields(client, server):
    multipart = {"Content-Type": "multipart/form-data; boundary=xyz"}
    nameless = b"--xyz\r\nContent-Type: text/plain\r\n\r\nhello\r\n--xyz--\r\n"
    status, body = server.raw("POST", "/files", nameless, multipart)
    assert status == 400 and body["error"]["code"] == "invalid_request", body
    status, body = server.raw("POST", "/files", b"--xyz\r\ngarbage", multipart)
    assert status == 400 and body["error"]["param"] == "purpose", body
    status, body = server.raw("POST", "/files", b"{}", {"Content-Type": "application/json"})
    assert status == 415 and body["error"]["code"] == "unsupported_media_type", body
    with pytest.raises(openai.BadRequestError) as exc:
        client.files.create(file=("x.jsonl", b"{}\n"), purpose="fine-tune")
    assert _envelope(exc.value)["param"] == "purpose"


def test_upload_over_the_limit_is_413(client):
    with pytest.raises(openai.APIStatusError) as exc:
        client.files.create(file=("big.jsonl", b"x" * (2 * 1024 * 1024)), purpose="batch")
    assert exc.value.status_code == 413
    assert _envelope(exc.value)["code"] == "file_too_large"


def test_create_is_validating_then_runs_or_fails(client):
    f = client.files.create(file=("ok.jsonl", good_file(3)), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
        metadata={"job": "t"},
    )  # fmt: skip
    assert b.status == "validating" and b.metadata == {"job": "t"}
    for _ in range(100):
        b = client.batches.retrieve(b.id)
        if b.status != "validating":
            break
    assert b.status == "in_progress" and b.request_counts.total == 3
    # no worker anywhere: cancelling settles at once, every line batch_cancelled
    b = client.batches.cancel(b.id)
    assert b.status == "cancelled"
    errors = client.files.content(b.error_file_id).text.splitlines()
    assert len(errors) == 3 and all("batch_cancelled" in e for e in errors)
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(wait_failed(client).id)  # a finished batch cannot be cancelled


def wait_failed(client):
    bad = jsonl(["not json", request_line("a", chat_body("q"), url="/v1/moderations")])
    f = client.files.create(file=("bad.jsonl", bad), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    assert b.status == "validating"
    b = wait_batch(client, b.id, timeout=30)
    assert b.status == "failed"
    codes = {e.code for e in b.errors.data}
    assert {"invalid_json_line", "invalid_url"} <= codes, b.errors
    return b


def test_endpoint_mismatch_fails_validation(client):
    f = client.files.create(file=("chat.jsonl", good_file()), purpose="batch")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
    )
    b = wait_batch(client, b.id, timeout=30)
    assert b.status == "failed" and b.errors.data[0].code == "invalid_url"
    assert [e.line for e in b.errors.data] == [1, 2]


def test_bad_create_requests(client):
    f = client.files.create(file=("in.jsonl", good_file()), purpose="batch")
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(
            input_file_id=f.id, endpoint="/v1/moderations", completion_window="24h"
        )
    assert _envelope(exc.value)["param"] == "endpoint"


def test_batches_list_newest_first_with_has_more(client):
    f = client.files.create(file=("in.jsonl", good_file()), purpose="batch")
    made = [
        client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
        for _ in range(3)
    ]
    page = client.batches.list(limit=2)
    assert page.has_more and [b.id for b in page.data] == made[::-1][:2]
    listed = [b.id for b in client.batches.list(limit=1)]  # every page, via the cursor
    assert listed[:3] == made[::-1] and len(listed) == len(set(listed))


def test_online_without_worker_is_503(client):
    with pytest.raises(openai.APIStatusError) as exc:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 503
    with pytest.raises(openai.BadRequestError):  # judged before any worker is needed
        client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], temperature=5
        )


def test_refuses_remote_bind_without_key(tmp_path):
    env = cli_env(tmp_path)
    env.pop("BATCHMLX_API_KEY", None)
    proc = subprocess.run(
        [sys.executable, "-m", "batchmlx.cli", "serve", "--host", "0.0.0.0", "--no-worker"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0 and "--allow-remote" in proc.stderr


def test_expires_after_on_files_and_batches(client):
    f = client.files.create(file=("in.jsonl", good_file()), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 7200})  # fmt: skip
    assert f.expires_at == f.created_at + 7200
    assert client.files.retrieve(f.id).expires_at == f.created_at + 7200
    with pytest.raises(openai.BadRequestError) as exc:
        client.files.create(file=("in.jsonl", good_file()), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 60})  # fmt: skip
    assert _envelope(exc.value)["param"] == "expires_after.seconds"
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 3600},
    )  # fmt: skip
    assert b.status == "validating"
    with pytest.raises(openai.BadRequestError) as exc:
        client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
            output_expires_after={"anchor": "now", "seconds": 3600},
        )  # fmt: skip
    assert _envelope(exc.value)["param"] == "output_expires_after.anchor"
