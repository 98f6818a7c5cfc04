"""A PostgreSQL of its own for tests that stop and restart it (the session's `pg_server` is
shared): `down` stops it, `up` starts the same data folder on the same port again."""

from __future__ import annotations

import os
import socket
import subprocess
import time

from tests.pg_server import NOBODY, PgServer, start_postgres


def down(server: PgServer) -> None:
    """A fast shutdown (SIGINT): clients are cut off, as when the database restarts."""
    if server.proc.poll() is None:
        server.proc.send_signal(2)
        server.proc.wait(30)


def up(server: PgServer, timeout: float = 60) -> None:
    """The same server command again (same data folder, same port), until it answers."""
    kw: dict = {}
    if os.geteuid() == 0:
        kw.update(user=NOBODY, group=NOBODY, extra_groups=[])
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH")}
    log = open(server.root / "server.log", "ab")  # noqa: SIM115 - the server writes it
    server.proc = subprocess.Popen(
        server.proc.args, stdout=log, stderr=subprocess.STDOUT, cwd=server.root, env=env,
        start_new_session=True, **kw,
    )  # fmt: skip
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.proc.poll() is None, (server.root / "server.log").read_text()[-800:]
        try:
            with socket.create_connection(("127.0.0.1", server.port), timeout=1):
                pass
            if _accepts(server):
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise AssertionError("postgres did not come back")


def _accepts(server: PgServer) -> bool:
    import asyncio

    import asyncpg

    async def probe() -> bool:
        try:
            conn = await asyncpg.connect(server.url().replace("+asyncpg", ""), timeout=2)
        except (OSError, asyncpg.PostgresError):
            return False
        await conn.close()
        return True

    return asyncio.run(probe())


__all__ = ["PgServer", "down", "start_postgres", "up"]
