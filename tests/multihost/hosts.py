"""Several "hosts" on one machine: each a process with its own $BATCHMLX_HOME (no shared disk)
and its own host name (BATCHMLX_WORKER_HOST), all on one PostgreSQL database."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchmlx.batches.files import file_content
from batchmlx.store import Store
from tests.e2e.helpers import cli_env, describe

LEASE_S = 8  # short, so a killed worker's requests are taken over soon; heartbeats every third


@dataclass
class Host:
    name: str
    home: Path
    database_url: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        env = cli_env(self.home)
        env |= {"BATCHMLX_DATABASE_URL": self.database_url, "BATCHMLX_WORKER_HOST": self.name,
                "BATCHMLX_LEASE_S": str(LEASE_S)}  # fmt: skip
        env.pop("BATCHMLX_CRASH_AT", None)
        return env

    def cli(self, *args: str | Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "batchmlx.cli", *map(str, args)],
            env=self.env, cwd=self.home, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def cli_json(self, *args: str | Path) -> Any:
        proc = self.cli(*args, "--json")
        assert proc.returncode == 0, describe(proc)
        return json.loads(proc.stdout)

    def start_worker(self, *args: str | Path) -> subprocess.Popen[bytes]:
        log = (self.home / "worker.log").open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchmlx.cli", "worker", *map(str, args)],
            env=self.env, cwd=self.home, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def log(self) -> str:
        path = self.home / "worker.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def make_hosts(base: Path, database_url: str, n: int, prefix: str = "host") -> list[Host]:
    hosts = []
    for i in range(n):
        home = base / f"{prefix}-{i}"
        home.mkdir(parents=True)
        hosts.append(Host(f"{prefix}-{i}", home, database_url))
    return hosts


def stop_all(hosts: list[Host]) -> dict[str, list[int | None]]:
    """SIGTERM every worker still running (graceful: leases given back), then wait."""
    for h in hosts:
        for p in h.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    codes: dict[str, list[int | None]] = {}
    for h in hosts:
        for p in h.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            codes.setdefault(h.name, []).append(p.returncode)
    return codes


async def wait_until_terminal(store: Store, batch_ids: list[str], hosts: list[Host],
                              timeout_s: float = 600) -> None:  # fmt: skip
    """Poll until every batch has ended (the workers run until told to stop)."""
    deadline = time.monotonic() + timeout_s
    while True:
        recs = [await store.get_batch(b) for b in batch_ids]
        if all(r.status.terminal for r in recs):
            return
        dead = [h.name for h in hosts for p in h.procs if p.poll() not in (None, -signal.SIGKILL)]
        assert not dead, f"workers exited: {dead}\n" + "\n".join(h.log() for h in hosts)
        assert time.monotonic() < deadline, [(r.id, r.status, r.request_counts) for r in recs]
        await asyncio.sleep(0.25)


async def custom_ids_in_files(store: Store, batch_id: str) -> tuple[list[str], list[dict]]:
    """Every custom_id in the batch's output and error files (read through `store`, which
    has its own home: the bytes come from the database), and the error lines."""
    rec = await store.get_batch(batch_id)
    out = (await file_content(store, rec.output_file_id)).splitlines()
    err_bytes = await file_content(store, rec.error_file_id)
    err = [json.loads(x) for x in err_bytes.splitlines()]
    return [json.loads(x)["custom_id"] for x in out] + [e["custom_id"] for e in err], err


async def rows(store: Store, sql: str, **params: Any) -> list[tuple[Any, ...]]:
    """Rows of a raw query, for checks the store has no named operation for."""
    from sqlalchemy import text

    async with store._reader.connect() as conn:
        return [tuple(r) for r in await conn.execute(text(sql), params)]
