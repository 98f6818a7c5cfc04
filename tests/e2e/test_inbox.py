"""`batchmlx worker --inbox DIR`: files already there, a slow writer, a duplicate, a bad file;
results land in DIR/results/ when each batch ends. A real worker process, a real SQLite file."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest

from batchmlx import batches
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus, RequestStatus
from batchmlx.core.records import RequestResult
from batchmlx.ingest import INBOX_HOOKS
from batchmlx.ingest.inbox import Inbox
from batchmlx.ingest.writers import can_tell, open_for_writing
from batchmlx.store import Store
from tests.crash.harness import Scenario
from tests.e2e.helpers import chat_body, make_cli, request_line
from tests.store_scenario import run_with_store


def _line(cid: str) -> str:
    return json.dumps(request_line(cid, chat_body(cid, model="default", max_tokens=4))) + "\n"


def _wait_for(pred, proc, log: Path, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def _result(results: Path, stem: str, kind: str) -> Path | None:
    """results/STEM.BATCH_ID.KIND.jsonl, the one file of that drop (None while there is none)."""
    found = list(results.glob(f"{stem}.batch_*.{kind}.jsonl"))
    assert len(found) <= 1, found
    return found[0] if found else None


def test_inbox(tmp_path: Path, tiny_model_dir: Path) -> None:
    s = Scenario(make_cli(tmp_path), tiny_model_dir)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "early.jsonl").write_text("".join(_line(f"e{i}") for i in range(3)))
    log = tmp_path / "worker.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchmlx.cli", "worker", "--model", str(tiny_model_dir),
         "--inbox", str(inbox), "--inbox-settle", "0.6"],
        env=s.cli.env, cwd=tmp_path, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        results = inbox / "results"
        _wait_for(lambda: _result(results, "early", "output"), proc, log)
        assert (inbox / "done" / "early.jsonl").exists() and not (inbox / "early.jsonl").exists()

        # a slow writer: whole lines, and one line cut in half, never 0.6 s apart in quiet...
        slow = inbox / "slow.jsonl"
        with slow.open("w") as f:
            for i in range(6):
                f.write(_line(f"s{i}"))
                f.flush()
                time.sleep(0.3)
            half = _line("s6")
            f.write(half[:20])
            f.flush()
            time.sleep(0.9)  # past the settle time, but no final newline yet: not complete
            assert slow.exists(), "ingested while a line was half-written"
            f.write(half[20:])
        # the same content as early.jsonl again: no second batch; and a file that is not JSON
        (inbox / "again.jsonl").write_text((inbox / "done" / "early.jsonl").read_text())
        (inbox / "bad.jsonl").write_text('{"custom_id": "x", broken\n')

        _wait_for(lambda: _result(results, "slow", "output"), proc, log)
        _wait_for(lambda: (inbox / "failed" / "bad.errors.json").exists(), proc, log)
        _wait_for(lambda: (inbox / "done" / "again.jsonl").exists(), proc, log)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    text = log.read_text()
    assert rc == 0 and "Traceback" not in text, text

    slow_out = [json.loads(x) for x in _result(results, "slow", "output").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in slow_out) == [f"s{i}" for i in range(7)]
    early = [json.loads(x) for x in _result(results, "early", "output").read_text().splitlines()]
    assert sorted(x["custom_id"] for x in early) == ["e0", "e1", "e2"]
    assert _result(results, "slow", "errors") is None
    report = json.loads((inbox / "failed" / "bad.errors.json").read_text())
    assert report["errors"]["data"][0]["line"] == 1
    assert (inbox / "failed" / "bad.jsonl").exists()
    with closing(s.db()) as conn:
        rows = conn.execute("SELECT status, source FROM batches ORDER BY created_at").fetchall()
    # early, slow, bad: the duplicate made no batch
    assert sorted(st for st, _ in rows) == ["completed", "completed", "failed"], rows
    assert all(src.startswith(f"inbox:{inbox.resolve()}/") for _, src in rows)


# -- what the inbox takes, and what it refuses (no model needed: the store, or `watch` alone) ---


def _rows(db: Path) -> list[tuple[str, str, int]]:
    """(status, source, request count) of every batch, oldest first."""
    with closing(sqlite3.connect(db, timeout=10)) as conn:
        return conn.execute(
            "SELECT b.status, b.source, (SELECT COUNT(*) FROM requests r WHERE r.batch_id = b.id)"
            " FROM batches b ORDER BY b.created_at, b.rowid"
        ).fetchall()


def _later(seconds: float = 100.0):
    """A clock past every settle time: a scan takes each quiet file at once."""
    return lambda: time.time() + seconds


def _finish(store: Store, batch_id: str, ok: bool) -> RequestResult:
    body = {"object": "chat.completion", "choices": []}
    error = {"code": "server_error", "message": "boom"}
    return RequestResult(
        status=RequestStatus.SUCCEEDED if ok else RequestStatus.FAILED,
        status_code=200 if ok else 500,
        body=body if ok else None,
        error=None if ok else error,
    )


def test_two_drops_of_one_name_keep_their_own_results(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()

    async def scenario(store: Store, settings: Settings) -> None:
        box = Inbox(settings, inbox, clock=_later())
        (inbox / "same.jsonl").write_text(_line("a"))
        [first] = await box.scan(store)
        (inbox / "same.jsonl").write_text(_line("b"))
        [second] = await box.scan(store)
        # the first ends with errors only, the second clean (and later)
        for rec, ok in ((first, False), (second, True)):
            await store.finish_unfinished(rec.id, _finish(store, rec.id, ok), 5.0)
            await batches.finalize.finalize(store, settings, rec.id, now=5.0, hooks=INBOX_HOOKS)
        results = inbox / "results"
        assert sorted(p.name for p in results.iterdir()) == sorted([
            f"same.{first.id}.output.jsonl", f"same.{first.id}.errors.jsonl",
            f"same.{second.id}.output.jsonl",
        ])  # fmt: skip
        errors = (results / f"same.{first.id}.errors.jsonl").read_text()
        assert json.loads(errors)["custom_id"] == "a"
        output = (results / f"same.{second.id}.output.jsonl").read_text()
        assert json.loads(output)["custom_id"] == "b"
        assert sorted(p.name for p in (inbox / "done").iterdir()) == ["same.1.jsonl", "same.jsonl"]

    run_with_store(tmp_path, scenario)


def test_failed_content_may_run_again_and_good_content_once(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    bad = '{"custom_id": "x", "method": "POST"}\n'  # no url, no body

    async def scenario(store: Store, settings: Settings) -> None:
        box = Inbox(settings, inbox, clock=_later())
        for _ in range(2):
            (inbox / "bad.jsonl").write_text(bad)
            [rec] = await box.scan(store)  # a batch each time: the failed one does not dedupe
            assert rec.status is BatchStatus.FAILED
        for _ in range(2):
            (inbox / "good.jsonl").write_text(_line("g"))
            await box.scan(store)
        failed = sorted(p.name for p in (inbox / "failed").iterdir())
        assert failed == ["bad.1.errors.json", "bad.1.jsonl", "bad.errors.json", "bad.jsonl"]
        assert sorted(p.name for p in (inbox / "done").iterdir()) == ["good.1.jsonl", "good.jsonl"]

    run_with_store(tmp_path, scenario)
    statuses = [status for status, _, _ in _rows(tmp_path / "home" / "batchmlx.db")]
    assert statuses == ["failed", "failed", "in_progress"]  # the second good.jsonl made none


def test_files_that_cannot_be_taken_go_to_failed_once(tmp_path: Path) -> None:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    secret = tmp_path / "secret.jsonl"
    secret.write_text(_line("secret"))
    (inbox / "link.jsonl").symlink_to(secret)
    (inbox / os.fsdecode(b"caf\xe9.jsonl")).write_text(_line("cafe"))
    deep = request_line("d", chat_body("d", model="default", response_format=[[[]]]))
    nested = json.dumps(deep).replace("[[[]]]", "[" * 300 + "]" * 300)
    (inbox / "deep.jsonl").write_text(nested + "\n")  # valid JSON orjson cannot write back
    (inbox / "fine.jsonl").write_text(_line("fine"))

    async def scenario(store: Store, settings: Settings) -> None:
        box = Inbox(settings, inbox, clock=_later())
        for _ in range(4):  # scans again and again: nothing is taken twice
            await box.scan(store)
        assert sorted(os.listdir(inbox)) == ["done", "failed"]
        inputs = [f for f in await store.list_files_page() if f.purpose == "batch"]
        assert sorted(f.filename for f in inputs) == ["deep.jsonl", "fine.jsonl"]
        assert len(list(settings.files_dir.iterdir())) == 2
        for f in inputs:
            assert b"secret" not in Path(f.path).read_bytes()

    run_with_store(tmp_path, scenario)
    failed = inbox / "failed"
    assert (failed / "link.jsonl").is_symlink() and secret.read_text() == _line("secret")
    reasons = {}
    for report in failed.glob("*.errors.json"):
        body = json.loads(report.read_bytes())
        reasons[body["file"]] = [(e["code"], e["line"]) for e in body["errors"]["data"]]
        assert all(e["message"] for e in body["errors"]["data"])
    assert reasons == {
        "link.jsonl": [("file_refused", None)],
        "caf\\xe9.jsonl": [("file_refused", None)],
        "deep.jsonl": [("invalid_json_line", 1)],
    }
    assert (failed / os.fsdecode(b"caf\xe9.jsonl")).exists()
    assert "symbolic link" in (failed / "link.errors.json").read_text()
    assert "not valid UTF-8" in (failed / os.fsdecode(b"caf\xe9.errors.json")).read_text()


_SLOW_WRITER = """
import sys, time
with open(sys.argv[1], "w") as f:
    for i, line in enumerate(sys.argv[2:]):
        f.write(line)
        f.flush()
        if i < len(sys.argv) - 3:
            time.sleep(1.3)
"""


def _watch(cli, inbox: Path, log: Path, *args: str, crash: str | None = None):
    env = dict(cli.env)
    env.pop("BATCHMLX_CRASH_AT", None)
    if crash:
        env["BATCHMLX_CRASH_AT"] = crash
    return subprocess.Popen(
        [sys.executable, "-m", "batchmlx.cli", "watch", str(inbox), *args],
        env=env, cwd=log.parent, stdout=log.open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def _stop(proc: subprocess.Popen, log: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log.read_text()
    assert "Traceback" not in log.read_text(), log.read_text()


def test_watch_waits_for_a_writer_that_pauses(tmp_path: Path) -> None:
    """A real writer holds the file open and pauses 1.3 s between lines, longer than the
    settle time: the file is taken only once the writer closes it, with every line."""
    cli = make_cli(tmp_path)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    log = tmp_path / "watch.log"
    proc = _watch(cli, inbox, log, "--settle", "0.4")
    try:
        lines = [_line(f"s{i}") for i in range(3)]
        writer = subprocess.run(
            [sys.executable, "-c", _SLOW_WRITER, str(inbox / "slow.jsonl"), *lines], timeout=60
        )
        assert writer.returncode == 0
        _wait_for(lambda: (inbox / "done" / "slow.jsonl").exists(), proc, log)
    finally:
        _stop(proc, log)
    assert (inbox / "done" / "slow.jsonl").read_text() == "".join(lines)
    assert [n for _, _, n in _rows(cli.home / "batchmlx.db")] == [3], log.read_text()


def test_watch_force_after_a_crash_between_commit_and_move(tmp_path: Path) -> None:
    """`watch --force` killed after the batch's commit, before the file moved: the restart
    finds the drop in the store and moves the file; it does not submit it again."""
    cli = make_cli(tmp_path)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "once.jsonl").write_text(_line("a") + _line("b"))
    log = tmp_path / "watch.log"
    proc = _watch(cli, inbox, log, "--force", "--settle", "0.2", crash="inbox_after_submit:1")
    assert proc.wait(timeout=60) == -signal.SIGKILL, log.read_text()
    assert (inbox / "once.jsonl").exists()
    assert len(_rows(cli.home / "batchmlx.db")) == 1
    proc = _watch(cli, inbox, log, "--force", "--settle", "0.2")
    try:
        _wait_for(lambda: (inbox / "done" / "once.jsonl").exists(), proc, log)
    finally:
        _stop(proc, log)
    [(status, source, n)] = _rows(cli.home / "batchmlx.db")
    assert (status, n) == ("in_progress", 2)
    assert source.startswith(f"inbox:{inbox.resolve() / 'once.jsonl'}#drop=")
    # the same bytes dropped again are a new drop: --force submits them
    (inbox / "once.jsonl").write_text(_line("a") + _line("b"))
    proc = _watch(cli, inbox, log, "--force", "--settle", "0.2")
    try:
        _wait_for(lambda: (inbox / "done" / "once.1.jsonl").exists(), proc, log)
    finally:
        _stop(proc, log)
    assert len(_rows(cli.home / "batchmlx.db")) == 2


def test_open_for_writing_sees_write_handles_only(tmp_path: Path) -> None:
    if not can_tell():
        pytest.skip("no /proc here: the settle time alone decides")
    a, b, c = (tmp_path / n for n in "abc")
    for p in (a, b, c):
        p.write_text("x\n")
    with a.open("a"), b.open("rb"), c.open("r+b"):
        assert open_for_writing([a, b, c]) == {a, c}
    assert open_for_writing([a, b, c]) == set()


def test_a_busy_database_leaves_the_file_in_the_inbox(tmp_path: Path) -> None:
    """Another writer holds SQLite's write lock past the busy timeout while a valid file is
    dropped: the file stays where it is (it used to go to failed/ for good, "database is
    locked") and becomes a batch at the first scan after the lock is let go."""
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache")
    (inbox / "good.jsonl").write_text(_line("g0") + _line("g1"))

    async def main() -> None:
        store = await Store.open(settings.db_path, busy_timeout_s=0.2)
        box = Inbox(settings, inbox, clock=_later())
        try:
            with closing(sqlite3.connect(settings.db_path, isolation_level=None)) as other:
                other.execute("BEGIN IMMEDIATE")  # the other writer
                for _ in range(2):  # scan after scan while it writes: nothing is refused
                    assert await box.scan(store) == []
                    assert (inbox / "good.jsonl").exists()
                    assert not any((inbox / "failed").iterdir())
                other.execute("ROLLBACK")
            [rec] = await box.scan(store)
            assert rec.status is BatchStatus.IN_PROGRESS and rec.request_counts.total == 2
            assert sorted(os.listdir(inbox / "done")) == ["good.jsonl"]
            assert len([f for f in await store.list_files_page() if f.purpose == "batch"]) == 1
        finally:
            await store.close()

    (inbox / "failed").mkdir()
    asyncio.run(main())
