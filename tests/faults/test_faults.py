"""One suite, one fault per case: a real worker process on a real SQLite file works through real
batches while a fault is injected; afterwards the worker is still alive (and stops cleanly on
SIGTERM), every custom_id is in exactly one output or error line, and `PRAGMA integrity_check`
is ok. Each fault here used to end the worker.

Faults are real where that is practical (a write lock held by another process, `results` that
is not a folder, token ids past the vocabulary, a cancel in a paused finalize); a full disk and
bugs are raised at named points (BATCHMLX_FAIL_AT, batchmlx/faults.py). Tests run as root here,
which writes through a 0o500 folder, so an unwritable inbox `results/` is a regular file instead.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from batchmlx import batches
from batchmlx.config import load_settings
from batchmlx.ingest.layout import SOURCE_PREFIX
from batchmlx.store import Store
from tests.crash.harness import Scenario
from tests.e2e.helpers import COMPLETIONS_URL, request_line, write_jsonl
from tests.faults.harness import LiveWorker, check_each_once, lines_of


def submit(s: Scenario, path: Path, ids: list[str], source: str = "cli") -> str:
    async def go() -> str:
        settings = load_settings(s.cli.env)
        store = await Store.open(settings.db_path)
        try:
            rec = await batches.intake.submit(
                store, settings, path.read_bytes(), filename=path.name,
                now=time.time(), source=source,
            )  # fmt: skip
            return rec.id
        finally:
            await store.close()

    batch_id = asyncio.run(go())
    s.inputs[batch_id] = ids
    return batch_id


@dataclass
class Case:
    """A fault: what to set up, the worker's extra environment, what to do while it runs, and
    what must hold afterwards besides the common checks."""

    env: dict[str, str] = field(default_factory=dict)
    setup: Callable[[Scenario, Path], dict[str, str]] | None = None  # -> expected statuses
    act: Callable[[Scenario, LiveWorker, Path], None] | None = None
    check: Callable[[Scenario, LiveWorker], None] | None = None


# -- database locked by another process past the busy timeout ---------------------------------


def _hold_write_lock(s: Scenario, w: LiveWorker, tmp: Path) -> None:
    w.wait_for("a first result", lambda: s.batch_row(next(iter(s.inputs)))["request_counts"][
        "completed"] > 0)  # fmt: skip
    with closing(sqlite3.connect(s.cli.home / "batchmlx.db", isolation_level=None)) as conn:
        conn.execute("BEGIN IMMEDIATE")  # the write lock, held well past the worker's 0.2 s
        w.wait_for("two retries", lambda: w.text().count("database is locked") >= 2)
        conn.execute("ROLLBACK")


def _retried_lock(s: Scenario, w: LiveWorker) -> None:
    assert "transient fault, retrying in" in w.text()


# -- an inbox whose results/ cannot be written ------------------------------------------------


def _inbox_results_blocked(s: Scenario, tmp: Path) -> dict[str, str]:
    inbox = tmp / "inbox"
    (inbox / "done").mkdir(parents=True)
    (inbox / "results").write_text("not a folder\n")  # root writes through chmod 0o500
    ids = ["in-0", "in-1"]
    path = write_jsonl(inbox / "done" / "boxed.jsonl", [
        request_line(i, {"model": "default", "messages": [{"role": "user", "content": i}],
                         "max_tokens": 4}) for i in ids])  # fmt: skip
    submit(s, path, ids, source=f"{SOURCE_PREFIX}{inbox / 'boxed.jsonl'}")
    return {}


def _inbox_copy_logged(s: Scenario, w: LiveWorker) -> None:
    boxed = [b for b in s.inputs if s.inputs[b][0] == "in-0"][0]
    stats = json.loads(s.batch_row(boxed)["stats"])
    assert "inbox_results_error" in stats, stats
    assert "inbox result copy not written" in w.text()
    assert all(len(v) == 1 and v[0]["response"]["status_code"] == 200
               for v in lines_of(s, boxed).values())  # fmt: skip


# -- completions prompts of token ids past the vocabulary -------------------------------------


def _token_ids_out_of_vocab(s: Scenario, tmp: Path) -> dict[str, str]:
    prompts = {"huge": [1, 2**40], "vocab": [1, 49152], "fine": [1, 2, 3]}  # tiny vocab: 49152
    path = write_jsonl(tmp / "ids.jsonl", [
        request_line(cid, {"model": "default", "prompt": p, "max_tokens": 3}, url=COMPLETIONS_URL)
        for cid, p in prompts.items()])  # fmt: skip
    submit(s, path, list(prompts))
    return {}


def _token_ids_rejected(s: Scenario, w: LiveWorker) -> None:
    batch = [b for b in s.inputs if "huge" in s.inputs[b]][0]
    seen = lines_of(s, batch)
    for cid in ("huge", "vocab"):
        (line,) = seen[cid]
        assert line["response"]["status_code"] == 400, line
        err = line["response"]["body"]["error"]
        assert (err["code"], err["param"], err["type"]) == (
            "invalid_value",
            "prompt",
            "invalid_request_error",
        )
        assert "out of range" in err["message"] and "49152 tokens" in err["message"], err
    assert seen["fine"][0]["response"]["status_code"] == 200


# -- cancel arriving while the batch finalizes -------------------------------------------------


def _cancel_in_finalize(s: Scenario, w: LiveWorker, tmp: Path) -> None:
    w.wait_for("finalize paused", lambda: (tmp / "finalize_start.reached").exists())
    first = next(iter(s.inputs))
    proc = s.cli("cancel", first)
    assert proc.returncode == 0, proc.stderr
    (tmp / "finalize_start.go").touch()


def _cancelled_keeps_results(s: Scenario, w: LiveWorker) -> None:
    first = next(iter(s.inputs))
    lines = lines_of(s, first)
    assert all(v[0]["response"]["status_code"] == 200 for v in lines.values()), lines


def _first_cancelled(s: Scenario, tmp: Path) -> dict[str, str]:
    return {next(iter(s.inputs)): "cancelled"}


def _engine_error_lines(s: Scenario, w: LiveWorker) -> None:
    """The requests in the engine when its step raised get a 500 line; the others ran."""
    lines = [v[0] for b in s.inputs for v in lines_of(s, b).values()]
    failed = [ln for ln in lines if ln["response"]["status_code"] == 500]
    assert 1 <= len(failed) <= 2, lines  # --max-batch-size 2
    assert all("The engine failed while running this request" in
               ln["response"]["body"]["error"]["message"] for ln in failed)  # fmt: skip
    assert sum(ln["response"]["status_code"] == 200 for ln in lines) == len(lines) - len(failed)


def _logged(text: str) -> Callable[[Scenario, LiveWorker], None]:
    def check(s: Scenario, w: LiveWorker) -> None:
        assert text in w.text(), w.text()

    return check


CASES: dict[str, Case] = {
    "database_locked": Case(
        env={"BATCHMLX_BUSY_TIMEOUT_S": "0.2"}, act=_hold_write_lock, check=_retried_lock
    ),
    "disk_full_writing_output": Case(
        env={"BATCHMLX_FAIL_AT": "store_file:1:ENOSPC"},
        check=_logged("transient fault, retrying in"),
    ),
    "inbox_results_not_writable": Case(setup=_inbox_results_blocked, check=_inbox_copy_logged),
    "prompt_token_ids_out_of_vocab": Case(setup=_token_ids_out_of_vocab, check=_token_ids_rejected),
    "cancel_during_finalize": Case(
        env={"BATCHMLX_PAUSE_AT": "finalize_start:1"},
        setup=_first_cancelled,
        act=_cancel_in_finalize,
        check=_cancelled_keeps_results,
    ),  # fmt: skip
    "finalize_raises": Case(
        env={"BATCHMLX_FAIL_AT": "before_finalize:1:error"},
        check=_logged("finalize failed, retrying in"),
    ),
    "engine_step_raises": Case(
        env={"BATCHMLX_FAIL_AT": "engine_step:3:error"}, check=_engine_error_lines
    ),
    "tick_raises": Case(
        env={"BATCHMLX_FAIL_AT": "mid_generation:2:error"},
        check=_logged("worker tick failed, retrying in"),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_worker_survives(tmp_path: Path, tiny_model_dir: Path, name: str) -> None:
    case = CASES[name]
    s = Scenario.new(tmp_path, tiny_model_dir, batches=2, per_batch=3, max_tokens=12)
    statuses = case.setup(s, tmp_path) if case.setup else {}
    env = {"BATCHMLX_PAUSE_DIR": str(tmp_path), **case.env}
    w = LiveWorker.start(s, env)
    try:
        if case.act:
            case.act(s, w, tmp_path)
        w.wait_all_done()
        assert w.stop() == 0, w.text()
    finally:
        w.kill()
    check_each_once(s, statuses)
    if case.check:
        case.check(s, w)
