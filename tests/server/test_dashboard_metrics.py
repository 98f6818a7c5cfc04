"""/metrics and the dashboard's JSON on a real `batchmlx serve` (tiny random model, API key):
the scrape is parsed with prometheus_client's own parser and checked against the batch's usage."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.helpers import chat_body, request_line
from tests.server.helpers import jsonl, start_server, wait_batch

KEY = "sk-dash-test"
SYSTEM = "You are a careful assistant who answers questions about numbers in plain words. " * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_dir):
    s = start_server(tmp_path_factory.mktemp("dash"), "--model", str(tiny_model_dir),
                     "--max-batch-size", "4", api_key=KEY)  # fmt: skip
    yield s
    s.stop()


def get(server, path: str, key: str | None = KEY) -> tuple[int, dict[str, str], bytes]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def scrape(server) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, headers, body = get(server, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def m(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_the_page_loads_without_the_key_but_its_data_needs_it(server):
    status, headers, body = get(server, "/", key=None)
    assert status == 200 and b'<script src="/static/dashboard.js"' in body
    assert "script-src 'self'" in headers["content-security-policy"]
    for path in ("/static/dashboard.js", "/static/dashboard.css"):
        assert get(server, path, key=None)[0] == 200
    for path in ("/dashboard/api/summary", "/metrics", "/v1/batches"):
        status, _, body = get(server, path, key=None)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert get(server, "/dashboard/api/summary", key="sk-wrong")[0] == 401
    # the public prefix leads nowhere else
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    for path in ("/static/../v1/batches", "/static/%2e%2e/v1/batches", "/static//v1/batches"):
        conn.request("GET", path)
        resp = conn.getresponse()
        assert resp.status == 404 and b"batch_" not in resp.read(), path
    conn.close()


def test_metrics_add_up_to_the_batch(server):
    client = server.client()
    before = scrape(server)
    lines = [
        request_line(
            f"q{i}",
            chat_body(f"Question {i}?", max_tokens=6)
            | {
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Question {i}?"},
                ]
            },
        )
        for i in range(6)
    ]
    lines.append(request_line("bad", chat_body("hot", max_tokens=4, temperature=5)))
    f = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")  # fmt: skip
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed"
    reply = client.chat.completions.create(
        model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return m(after, name, **labels) - m(before, name, **labels)

    usage = batch.usage
    cached = usage.input_tokens_details.cached_tokens
    assert delta("batchmlx_requests_completed_total", source="batch") == 6
    assert delta("batchmlx_requests_failed_total", source="batch") == 1
    assert delta("batchmlx_requests_completed_total", source="online") == 1
    assert delta("batchmlx_prompt_tokens_total") == usage.input_tokens + reply.usage.prompt_tokens
    assert delta("batchmlx_cached_tokens_total") == cached + (
        reply.usage.prompt_tokens_details.cached_tokens if reply.usage.prompt_tokens_details else 0
    )
    assert cached > 0  # six prompts share a long system prompt
    # every sampled token, end-of-sequence ones included
    assert delta("batchmlx_generated_tokens_total") >= (
        usage.output_tokens + reply.usage.completion_tokens
    )
    outcomes = {o: delta("batchmlx_prefix_cache_outcomes_total", outcome=o)
                for o in ("MISS", "HIT", "PREFIX_HIT")}  # fmt: skip
    assert sum(outcomes.values()) == 7  # one first admission per request that ran (6 + online)
    assert outcomes["HIT"] + outcomes["PREFIX_HIT"] >= 1
    steps = delta("batchmlx_step_seconds_count")
    assert steps >= 1 and delta("batchmlx_step_seconds_bucket", le="+Inf") == steps
    assert m(after, "batchmlx_running_batch_size") == 0
    assert m(after, "batchmlx_kv_blocks", state="in_use") == 0
    assert m(after, "batchmlx_kv_blocks", state="cached") > 0
    # queue depth: the gauges agree with every batch the API lists
    batches = client.batches.list(limit=100).data
    assert m(after, "batchmlx_batches", status="completed") == sum(
        b.status == "completed" for b in batches
    )
    assert m(after, "batchmlx_queue_requests", status="succeeded") == sum(
        b.request_counts.completed for b in batches
    )
    assert m(after, "batchmlx_queue_requests", status="failed") == sum(
        b.request_counts.failed for b in batches
    )
    assert m(after, "batchmlx_queue_requests", status="queued") == 0

    # the dashboard's view of the same batch
    status, _, body = get(server, f"/dashboard/api/batches/{batch.id}")
    assert status == 200
    view = json.loads(body)
    d = view["dashboard"]
    assert (view["status"], d["done"], d["progress"], d["eta_s"]) == ("completed", 7, 1.0, None)
    assert d["cached_tokens"] == cached
    assert d["cache_hit_rate"] == pytest.approx(cached / usage.input_tokens)
    assert sum(d["outcomes"].values()) == 6
    assert [(e["custom_id"], e["status_code"]) for e in view["error_lines"]] == [("bad", 400)]
    assert view["in_progress_at"] is not None and view["completed_at"] is not None

    time.sleep(1.1)  # the series leaves out the second still filling
    status, _, body = get(server, "/dashboard/api/summary")
    summary = json.loads(body)
    assert batch.id in [b["id"] for b in summary["batches"]]
    series = summary["series"]
    assert len(series) == 300 and series[-1]["t"] == int(summary["now"]) - 1
    generated = sum(p["tokens"] for p in series)  # spread over steps' seconds, rounded
    assert 0 < generated <= m(after, "batchmlx_generated_tokens_total") + 0.05 * len(series)
    assert 1 <= max(p["running"] for p in series) <= 4  # --max-batch-size 4
    assert summary["engine"]["running"] == 0 and summary["worker"] is True
