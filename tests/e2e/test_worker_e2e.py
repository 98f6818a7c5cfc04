"""A long-lived `batchmlx worker` in the background; `submit --wait` follows it; SIGTERM stops it.

The tests of this module share one worker process and run in file order: the last one stops it.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai.types import Batch, Completion
from openai.types.chat import ChatCompletion

from tests.e2e.helpers import (
    REPO,
    Cli,
    chat_body,
    describe,
    make_cli,
    read_jsonl,
    request_line,
    write_jsonl,
)

pytestmark = pytest.mark.real_model

START_S = 60  # the worker process is up and has sent its first heartbeat
STOP_S = 30  # after SIGTERM


@dataclass
class BackgroundWorker:
    cli: Cli
    proc: subprocess.Popen[bytes]
    log: Path

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(self.cli.home / "batchmlx.db", timeout=10)

    def registered_pids(self) -> list[int]:
        with closing(self.db()) as conn:
            return [pid for (pid,) in conn.execute("SELECT pid FROM workers")]

    def request_statuses(self, batch_id: str) -> dict[str, str]:
        with closing(self.db()) as conn:
            rows = conn.execute(
                "SELECT custom_id, status FROM requests WHERE batch_id = ?", (batch_id,)
            )
            return dict(rows.fetchall())

    def request_workers(self, batch_id: str) -> set[str | None]:
        with closing(self.db()) as conn:
            rows = conn.execute("SELECT worker_id FROM requests WHERE batch_id = ?", (batch_id,))
            return {worker_id for (worker_id,) in rows}


def _wait_registered(w: BackgroundWorker) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        assert w.proc.poll() is None, f"worker exited early:\n{w.log_text()}"
        if (w.cli.home / "batchmlx.db").exists():
            try:
                if w.proc.pid in w.registered_pids():
                    return
            except sqlite3.OperationalError:
                pass  # the schema is being created
        time.sleep(0.2)
    pytest.fail(f"worker did not register within {START_S}s:\n{w.log_text()}")


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundWorker]:
    base = tmp_path_factory.mktemp("worker_e2e")
    cli = make_cli(base)
    # create the database first, so the worker and the test never race to migrate it
    assert cli.json("list") == []
    w = BackgroundWorker(cli, cli.popen("worker", log=base / "worker.log"), base / "worker.log")
    try:
        _wait_registered(w)
        yield w
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait(timeout=30)


def _submit_wait(w: BackgroundWorker, path: Path) -> tuple[dict, subprocess.CompletedProcess]:
    proc = w.cli("submit", path, "--wait", "--json", timeout=300)
    assert proc.returncode == 0, describe(proc) + "\nworker log:\n" + w.log_text()
    return json.loads(proc.stdout), proc


def _results(w: BackgroundWorker, batch_id: str, name: str) -> list[dict]:
    path = w.cli.home.parent / name
    proc = w.cli("results", batch_id, "-o", path)
    assert proc.returncode == 0, describe(proc)
    return read_jsonl(path)


def test_submit_wait_follows_the_running_worker(worker: BackgroundWorker) -> None:
    ids = ["w1", "w2", "w3"]
    questions = ["Name a fruit.", "Name a color.", "Name a country."]
    path = write_jsonl(
        worker.cli.home.parent / "chat.jsonl",
        [
            request_line(i, chat_body(q, model="default", temperature=0, max_tokens=8))
            for i, q in zip(ids, questions, strict=True)
        ],
    )
    obj, _ = _submit_wait(worker, path)
    batch = Batch.model_validate(obj)
    assert batch.status == "completed"
    assert batch.request_counts is not None
    assert batch.request_counts.model_dump() == {"total": 3, "completed": 3, "failed": 0}
    assert batch.error_file_id is None and batch.output_file_id

    # the background worker ran every request: `submit --wait` did not start its own
    holders = worker.request_workers(batch.id)
    assert len(holders) == 1
    (holder,) = holders
    assert holder is not None and f"-{worker.proc.pid}-" in holder
    assert worker.proc.poll() is None

    lines = _results(worker, batch.id, "chat-out.jsonl")
    assert sorted(ln["custom_id"] for ln in lines) == ids
    for ln in lines:
        assert ln["response"]["status_code"] == 200
        body = ChatCompletion.model_validate(ln["response"]["body"])
        assert body.model == "SmolLM2-135M-Instruct"
        assert body.usage is not None and 0 < body.usage.completion_tokens <= 8


def test_completions_file_gives_text_completions(worker: BackgroundWorker) -> None:
    src = REPO / "jobs" / "examples" / "completions.jsonl"
    requests = read_jsonl(src)
    assert all(r["url"] == "/v1/completions" for r in requests)
    obj, _ = _submit_wait(worker, src)
    batch = Batch.model_validate(obj)
    assert batch.status == "completed"
    assert batch.endpoint == "/v1/completions"
    assert batch.request_counts is not None
    assert batch.request_counts.completed == batch.request_counts.total == len(requests)

    lines = {ln["custom_id"]: ln for ln in _results(worker, batch.id, "completions-out.jsonl")}
    assert set(lines) == {r["custom_id"] for r in requests}
    for r in requests:
        ln = lines[r["custom_id"]]
        assert ln["id"].startswith("batch_req_")
        assert ln["response"]["status_code"] == 200
        body = ln["response"]["body"]
        completion = Completion.model_validate(body)
        assert completion.object == "text_completion"
        assert completion.id.startswith("cmpl-")
        assert completion.model == "SmolLM2-135M-Instruct"
        assert len(completion.choices) == 1
        choice = completion.choices[0]
        assert choice.text and choice.finish_reason in ("stop", "length")
        assert choice.logprobs is None
        assert completion.usage is not None
        assert 0 < completion.usage.completion_tokens <= r["body"].get("max_tokens", 16)
        assert "cached_tokens" in body["usage"]["prompt_tokens_details"]
    by_prompt = {r["body"]["prompt"]: lines[r["custom_id"]] for r in requests}
    france = by_prompt.get("The capital of France is")
    if france is not None:
        assert "Paris" in france["response"]["body"]["choices"][0]["text"]


def _long_file(w: BackgroundWorker, name: str, ids: list[str], max_tokens: int = 16) -> Path:
    return write_jsonl(
        w.cli.home.parent / name,
        [
            request_line(i, chat_body(f"Tell me a story about {i}.", model="default",
                                      temperature=0, max_tokens=max_tokens))
            for i in ids
        ],
    )  # fmt: skip


def _poll_status(w: BackgroundWorker, batch_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        obj = w.cli.json("status", batch_id)
        if obj["status"] in ("completed", "failed", "cancelled", "expired"):
            return obj
        if time.monotonic() > deadline:
            pytest.fail(f"batch still {obj['status']} after {timeout}s:\n{w.log_text()}")
        time.sleep(0.3)


def test_cancel_while_the_worker_runs(worker: BackgroundWorker) -> None:
    # long enough that the cancel (a CLI process, ~1 s) lands while it runs: 4 x 16 tokens
    # were done before it on a fast CPU (the cancel then got OpenAI's 400 for a completed
    # batch); cancelled, it does not run to the end
    ids = [f"k{i}" for i in range(8)]
    path = _long_file(worker, "cancel.jsonl", ids, max_tokens=512)
    batch_id = worker.cli.json("submit", path)["id"]
    cancelled = worker.cli.json("cancel", batch_id)
    # a live worker settles it: cancelling now (or already settled, if it was that quick)
    assert cancelled["status"] in ("cancelling", "cancelled")
    assert cancelled["cancelling_at"] is not None
    obj = _poll_status(worker, batch_id, timeout=60)
    batch = Batch.model_validate(obj)
    assert batch.status == "cancelled", obj
    assert batch.cancelled_at is not None
    counts = batch.request_counts
    assert counts is not None and counts.total == 8
    assert counts.completed + counts.failed == 8 and counts.failed > 0

    base = worker.cli.home.parent
    out_p, err_p = base / "cancel-out.jsonl", base / "cancel-err.jsonl"
    for path, args, lines in ((out_p, (), counts.completed), (err_p, ("--errors",), counts.failed)):
        proc = worker.cli("results", batch_id, *args, "-o", path)
        assert proc.returncode == (0 if lines else 3), describe(proc)  # 3: no such file
    out, err = (read_jsonl(p) if p.exists() else [] for p in (out_p, err_p))
    assert len(out) == counts.completed and len(err) == counts.failed
    assert sorted(ln["custom_id"] for ln in out + err) == ids
    for ln in err:
        assert ln["response"] is None
        assert ln["error"]["code"] == "batch_cancelled"
    for ln in out:
        assert ln["response"]["status_code"] == 200
    assert worker.proc.poll() is None, worker.log_text()


def test_sigterm_stops_the_worker_cleanly(worker: BackgroundWorker) -> None:
    """SIGTERM in the middle of a batch: the worker exits 0, gives back what it held, and a
    later worker finishes the batch."""
    ids = [f"s{i}" for i in range(4)]
    batch_id = worker.cli.json("submit", _long_file(worker, "sigterm.jsonl", ids))["id"]
    deadline = time.monotonic() + 60
    while "running" not in worker.request_statuses(batch_id).values():
        statuses = set(worker.request_statuses(batch_id).values())
        if statuses <= {"succeeded", "failed"} or time.monotonic() > deadline:
            break  # finished (or never started) before we could interrupt it; still stop it
        time.sleep(0.05)

    assert worker.proc.poll() is None, worker.log_text()
    worker.proc.send_signal(signal.SIGTERM)
    try:
        rc = worker.proc.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"worker still running {STOP_S}s after SIGTERM:\n{worker.log_text()}")
    log = worker.log_text()
    assert rc == 0, log
    assert "Traceback" not in log
    # it deregistered (a later `submit --wait` will not wait on a dead worker) and released
    # its leases: nothing is left running under a worker that is gone
    assert worker.registered_pids() == []
    assert "running" not in worker.request_statuses(batch_id).values()

    # a fresh worker picks the batch up and finishes it
    proc = worker.cli("worker", "--until-idle", timeout=300)
    assert proc.returncode == 0, describe(proc)
    obj = worker.cli.json("status", batch_id)
    assert obj["status"] == "completed", obj
    assert obj["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    out = _results(worker, batch_id, "sigterm-out.jsonl")
    assert sorted(ln["custom_id"] for ln in out) == ids
