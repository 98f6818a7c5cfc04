"""Crash-test harness: real `batchmlx worker` processes on a real SQLite file, killed at named
points (BATCHMLX_CRASH_AT, see batchmlx/faults.py), then checked for durability."""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

from batchmlx import batches
from batchmlx.config import load_settings
from batchmlx.store import Store
from tests.e2e.helpers import Cli, chat_body, describe, make_cli, request_line, write_jsonl

KILLED = -signal.SIGKILL


@dataclass
class Scenario:
    """A $BATCHMLX_HOME with batches submitted, and the worker runs made on it."""

    cli: Cli
    model: Path
    inputs: dict[str, list[str]] = field(default_factory=dict)  # batch id -> custom ids
    runs: list[tuple[str, int]] = field(default_factory=list)  # (crash spec, rc)

    @classmethod
    def new(
        cls,
        base: Path,
        model: Path,
        batches: int,
        per_batch: int,
        max_tokens: int = 4,
        **params: object,
    ):
        """`params`: more fields of every line's body (temperature, ...)."""
        s = cls(make_cli(base), model)
        for b in range(batches):
            ids = [f"b{b}-r{i}" for i in range(per_batch)]
            path = write_jsonl(
                base / f"in{b}.jsonl",
                [request_line(i, chat_body(f"Say {i}.", model="default", max_tokens=max_tokens,
                                         **params))
                 for i in ids],
            )  # fmt: skip
            s.inputs[s.submit(path)] = ids
        return s

    def submit(self, path: Path) -> str:
        """Enqueue in-process (the CLI's submit is tested elsewhere; this saves a process)."""

        async def go() -> str:
            settings = load_settings(self.cli.env)
            store = await Store.open(settings.db_path)
            try:
                rec = await batches.intake.submit(
                    store, settings, path.read_bytes(), filename=path.name, now=time.time()
                )
                return rec.id
            finally:
                await store.close()

        return asyncio.run(go())

    def batch_row(self, batch_id: str) -> dict:
        with closing(self.db()) as conn:
            conn.row_factory = sqlite3.Row
            row = dict(conn.execute("SELECT * FROM batches WHERE id = ?", (batch_id,)).fetchone())
            row["request_counts"] = dict(
                zip(
                    ("total", "completed", "failed"),
                    conn.execute(
                        "SELECT COUNT(*), COALESCE(SUM(status = 'succeeded'), 0), "
                        "COALESCE(SUM(status = 'failed'), 0) FROM requests WHERE batch_id = ?",
                        (batch_id,),
                    ).fetchone(),
                    strict=True,
                )
            )
        return row

    def worker(self, crash: str | None = None, *args: str, timeout: float = 120):
        env = dict(self.cli.env)
        env.pop("BATCHMLX_CRASH_AT", None)
        if crash:
            env["BATCHMLX_CRASH_AT"] = crash
        proc = subprocess.run(
            [sys.executable, "-m", "batchmlx.cli", "worker", "--until-idle",
             "--model", str(self.model), "--max-batch-size", "2", *args],
            env=env, cwd=self.cli.home.parent, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        self.runs.append((crash or "-", proc.returncode))
        return proc

    def db(self) -> sqlite3.Connection:
        return sqlite3.connect(self.cli.home / "batchmlx.db", timeout=10)

    def attempts(self) -> dict[str, int]:
        with closing(self.db()) as conn:
            return dict(conn.execute("SELECT custom_id, attempts FROM requests"))

    def check_consistent(self) -> None:
        """What must hold after any crash: the database is sound, no temp file is left behind
        under a real name, and every finished file is complete JSONL."""
        with closing(self.db()) as conn:
            assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            dup = conn.execute(
                "SELECT batch_id, custom_id, COUNT(*) FROM requests "
                "GROUP BY batch_id, custom_id HAVING COUNT(*) > 1"
            ).fetchall()
            assert dup == []
        for f in (self.cli.home / "files").iterdir():
            if f.name.startswith("."):
                continue  # a temp file a kill interrupted: never under the real name
            data = f.read_bytes()
            assert data.endswith(b"\n"), f
            for line in data.splitlines():
                json.loads(line)

    def check_done(self) -> dict[str, dict]:
        """After recovery: every batch completed, every custom_id exactly once across its
        output and error files. Returns the Batch objects."""
        self.check_consistent()
        batches = {}
        for batch_id, ids in self.inputs.items():
            obj = self.batch_row(batch_id)
            assert obj["status"] == "completed", (obj, self.runs)
            seen: list[str] = []
            for key in ("output_file_id", "error_file_id"):
                if obj[key]:
                    path = self.cli.home / "files" / obj[key]
                    seen += [json.loads(ln)["custom_id"] for ln in path.read_text().splitlines()]
            assert sorted(seen) == sorted(ids), (batch_id, seen)
            batches[batch_id] = obj
        return batches


def run_ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, describe(proc)
    assert "database is locked" not in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr, describe(proc)
