"""`--database-url` on any command (before or after it) and BATCHMLX_DATABASE_URL pick the queue:
two homes on one PostgreSQL see the same batches and the same file bytes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import chat_body, cli_env, describe, request_line, write_jsonl
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
            proc.stderr
        ), describe(proc)
        assert "Traceback" not in proc.stderr and "secret" not in proc.stderr


# -- the password kept off the command line (issue 21) ---------------------------------------

SECRET = "S3cret pw!"  # a space and a "!": read from the file as they are
ROLE = "bmx_secret"


@pytest.fixture
def password_url(pg_server, pg_url) -> str:
    """pg_url's database, owned by a role that must give a password (scram-sha-256; the suite's
    server trusts every other role): its URL without the password."""
    from sqlalchemy.engine import make_url

    hba = pg_server.root / "data" / "pg_hba.conf"
    rule = f"host all {ROLE} 127.0.0.1/32 scram-sha-256\n"
    text = hba.read_text()
    if rule not in text:
        hba.write_text(rule + text)  # first match wins: before the trust lines
    url = make_url(pg_url)

    async def setup() -> None:
        import asyncpg

        conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{url.port}/postgres")
        try:
            if not await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", ROLE):
                await conn.execute(f"CREATE ROLE {ROLE} LOGIN PASSWORD '{SECRET}'")
            await conn.execute(f'ALTER DATABASE "{url.database}" OWNER TO {ROLE}')
            await conn.execute("SELECT pg_reload_conf()")
        finally:
            await conn.close()

    asyncio.run(setup())
    return f"postgresql://{ROLE}@127.0.0.1:{url.port}/{url.database}"


def _cli(home: Path, *args: str, env: dict[str, str] | None = None):
    full = cli_env(home)
    for name in ("BATCHMLX_DATABASE_URL", "BATCHMLX_DATABASE_PASSWORD_FILE", "PGPASSWORD"):
        full.pop(name, None)
    return subprocess.run([sys.executable, "-m", "batchmlx.cli", *args], env=full | (env or {}),
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def _one_clean_line(proc) -> str:
    assert proc.returncode == 1, describe(proc)
    assert "Traceback" not in proc.stderr and SECRET not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), describe(proc)
    return lines[0]


def test_the_password_comes_from_a_file_not_the_command_line(password_url, tmp_path):
    secret = tmp_path / "pw"
    secret.write_text(SECRET + "\n")
    home = tmp_path / "home"
    # without it the server refuses: the role really needs its password
    line = _one_clean_line(_cli(home, "--database-url", password_url, "list"))
    assert "password authentication failed" in line, line
    # the flag (after the command, too) and the environment variable
    for args, env in (
        (("list", "--json", "--database-url", password_url, "--database-password-file",
          str(secret)), {}),
        (("list", "--json"), {"BATCHMLX_DATABASE_URL": password_url,
                              "BATCHMLX_DATABASE_PASSWORD_FILE": str(secret)}),
        # libpq's convention, read by asyncpg for a URL without a password
        (("list", "--json", "--database-url", password_url), {"PGPASSWORD": SECRET}),
    ):  # fmt: skip
        proc = _cli(home, *args, env=env)
        assert proc.returncode == 0, describe(proc)
        assert json.loads(proc.stdout) == []


def test_a_wrong_or_doubled_password_is_one_line_without_it(password_url, tmp_path):
    home = tmp_path / "home"
    wrong = password_url.replace(f"{ROLE}@", f"{ROLE}:{SECRET.replace(' ', '%20')}x@")
    line = _one_clean_line(_cli(home, "--database-url", wrong, "status"))
    assert f"{ROLE}:***@" in line
    secret = tmp_path / "pw"
    secret.write_text(SECRET)
    both = _cli(home, "--database-url", wrong, "--database-password-file", str(secret), "list")
    assert "password file is given too" in _one_clean_line(both)
    missing = _cli(home, "--database-password-file", str(tmp_path / "nope"), "list",
                   env={"BATCHMLX_DATABASE_URL": password_url})  # fmt: skip
    assert "cannot read the database password file" in _one_clean_line(missing)
