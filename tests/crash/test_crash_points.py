"""SIGKILL the worker at every named point, restart it, and check nothing is lost or doubled.

Like SQLite's crash tests, a loop over crash points: each case runs a real worker process that
kills itself (BATCHMLX_CRASH_AT=point:n) against a real SQLite file, then a fresh worker that
must finish the job. Uses a tiny random-weight model: this is about durability, not text.
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import pytest

from batchmlx.faults import POINTS
from tests.crash.harness import KILLED, Scenario, run_ok

# (point, n): the n-th time the point is reached; two batches of 3 requests, 2 in the engine
CASES = [
    ("after_claim", 1),  # first claim: nothing ran
    ("after_claim", 2),  # second batch's claim, first batch's requests leased too
    ("mid_generation", 1),  # first engine step
    ("mid_generation", 4),  # some requests finished, not yet written
    ("after_result_write", 1),  # some results committed
    ("after_result_write", 2),
    ("finalize_start", 1),  # first batch's results read, status not moved
    ("before_finalize", 1),  # first batch finalizing, no file written
    ("before_finalize", 2),  # first batch completed, second finalizing
    ("store_file", 2),  # first batch completed, second about to write its output file
    ("mid_finalize", 1),  # output file written, error file and status not
    ("mid_finalize", 2),
    ("after_finalize_files", 1),  # every file written, status not moved
    ("after_finalize_files", 2),
]
# worker_loop is reached only under `serve`; a kill at engine_step is one at mid_generation; the
# inbox's point is the inbox's test (tests/e2e/test_inbox.py): a worker never reaches it;
# after_preemption needs more urgent work than these batches (tests/crash/test_preemption.py)
assert {p for p, _ in CASES} == set(POINTS) - {"worker_loop", "engine_step", "inbox_after_submit",
                                               "after_preemption"}  # fmt: skip


FINALIZE_POINTS = ("finalize_start", "before_finalize", "store_file", "mid_finalize",
                   "after_finalize_files")  # fmt: skip


@pytest.mark.parametrize(("point", "nth"), CASES, ids=[f"{p}:{n}" for p, n in CASES])
def test_killed_worker_recovers(tmp_path: Path, tiny_model_dir: Path, point: str, nth: int):
    s = Scenario.new(tmp_path, tiny_model_dir, batches=2, per_batch=3)
    before = s.attempts()
    crashed = s.worker(f"{point}:{nth}")
    assert crashed.returncode == KILLED, f"{point}:{nth} never reached:\n{crashed.stderr}"
    s.check_consistent()
    written = {cid for cid, n in s.attempts().items() if n}
    with closing(s.db()) as conn:
        done = {c for (c,) in conn.execute("SELECT custom_id FROM requests WHERE status != "
                                           "'queued' AND status != 'running'")}  # fmt: skip
    run_ok(s.worker())
    batches = s.check_done()
    for obj in batches.values():
        assert obj["request_counts"]["failed"] == 0
    after = s.attempts()
    # a request ran again only if the killed worker had claimed it; nothing ran three times
    assert all(after[c] <= before[c] + 2 for c in after)
    assert all(after[c] == 1 for c in after if c not in written)
    # a result committed before the kill is never re-run; at a finalize point that is at least
    # the whole batch being finalized (the other one may still have been running)
    assert all(after[c] == 1 for c in done)
    if point in FINALIZE_POINTS:
        assert len(done) >= 3


def test_request_that_keeps_killing_the_worker_is_given_up(tmp_path: Path, tiny_model_dir):
    """Killed mid-generation on every run: after --max-attempts runs the requests go to the
    error file with a clear message, and the batch still finishes."""
    s = Scenario.new(tmp_path, tiny_model_dir, batches=1, per_batch=2)
    for _ in range(2):
        assert s.worker("mid_generation:1", "--max-attempts", "2").returncode == KILLED
        s.check_consistent()
    run_ok(s.worker(None, "--max-attempts", "2"))
    (obj,) = s.check_done().values()
    assert obj["request_counts"] == {"total": 2, "completed": 0, "failed": 2}
    errors = (s.cli.home / "files" / obj["error_file_id"]).read_text()
    assert errors.count("gave up after 2 attempts") == 2
