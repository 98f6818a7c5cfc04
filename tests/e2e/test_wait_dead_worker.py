"""`submit --wait` when the worker it would follow is dead: a crashed worker's heartbeat stays
fresh for up to the lease (60 s), and the waiter used to follow it for ever (seen on a machine
where the worker died of an illegal instruction). Now it sees the process is gone and runs a
worker of its own."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from batchmlx.config import load_settings
from batchmlx.store import Store
from tests.e2e.helpers import chat_body, describe, make_cli, request_line, write_jsonl

pytestmark = pytest.mark.real_model


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


async def _register_dead_worker(env: dict[str, str]) -> None:
    settings = load_settings(env)
    store = await Store.from_settings(settings)
    try:
        await store.heartbeat("w-dead", store.clock(), settings.lease_s, pid=_dead_pid(),
                              hostname=settings.hostname)  # fmt: skip
        assert await store.live_workers(store.clock(), settings.lease_s) == ["w-dead"]
    finally:
        await store.close()


def test_wait_runs_a_worker_when_the_live_one_is_dead(tmp_path) -> None:
    cli = make_cli(tmp_path)
    asyncio.run(_register_dead_worker(cli.env))
    lines = [request_line("q", chat_body("Say hi.", temperature=0, max_tokens=4))]
    path = write_jsonl(tmp_path / "one.jsonl", lines)
    proc = cli("submit", path, "--wait", "--json", timeout=300)
    assert proc.returncode == 0, describe(proc)
    batch = json.loads(proc.stdout)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
