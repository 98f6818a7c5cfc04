"""`--database-url` on any command (before or after it) and BATCHMLX_DATABASE_URL pick the queue:
two homes on one PostgreSQL see the same batches and the same file bytes."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.e2e.helpers import chat_body, describe, request_line, write_jsonl
from tests.multihost.hosts import make_hosts


def test_two_homes_share_batches_and_files_through_the_url(pg_url, tmp_path):
    a, b = make_hosts(tmp_path, pg_url, 2)
    path = write_jsonl(tmp_path / "in.jsonl", [
        request_line("x", chat_body("Hi", model="default", max_tokens=1)),
        request_line("x", chat_body("Hi", model="default", max_tokens=1)),  # a duplicate
    ])  # fmt: skip
    env_a = {k: v for k, v in a.env.items() if k != "BATCHMLX_DATABASE_URL"}
    # after the command, on a home with no URL in its environment
    proc = subprocess.run(
        [sys.executable, "-m", "batchmlx.cli", "submit", str(path), "--json",
         "--database-url", pg_url],
        env=env_a, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, describe(proc)  # validation failed: a failed batch, exit 1
    batch = json.loads(proc.stdout)
    assert batch["status"] == "failed"
    # before the command, from the other home
    proc = b.cli("--database-url", pg_url, "status", batch["id"], "--json")
    assert proc.returncode == 0, describe(proc)
    assert json.loads(proc.stdout)["errors"]["data"][0]["code"] == "duplicate_custom_id"
    # and through the environment alone
    listed = b.cli_json("list")
    assert [x["id"] for x in listed] == [batch["id"]]
    # the input file's bytes are in the database, not on a's disk
    assert not (a.home / "files").exists()
    # the local SQLite of a home without the URL knows nothing of it
    proc = subprocess.run([sys.executable, "-m", "batchmlx.cli", "list", "--json"], env=env_a,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0 and json.loads(proc.stdout) == [], describe(proc)


def test_an_unreachable_database_is_a_clear_error(tmp_path):
    (a,) = make_hosts(tmp_path, "postgresql://batchmlx:secret@127.0.0.1:1/nowhere", 1)
    for args in (("status",), ("worker", "--until-idle")):
        proc = a.cli(*args)
        assert proc.returncode == 1, describe(proc)
        assert "cannot open the database postgresql+asyncpg://batchmlx:***@127.0.0.1:1" in (
            proc.stderr), describe(proc)
        assert "Traceback" not in proc.stderr and "secret" not in proc.stderr
