"""A real `batchmlx serve` in a subprocess on a free loopback port, for the openai client."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.e2e.helpers import cli_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    port: int
    home: Path
    log: Path
    api_key: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def client(self, api_key: str | None = None, **kwargs: Any):
        from openai import OpenAI

        key = api_key or self.api_key or "unused"
        return OpenAI(base_url=self.base_url, api_key=key, max_retries=0, **kwargs)

    def raw(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any]:
        """One plain HTTP request: (status, parsed JSON or bytes)."""
        headers = dict(headers or {})
        if self.api_key and "Authorization" not in headers:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(
            self.base_url + path, data=body, method=method, headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                status, data = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, data = exc.code, exc.read()
        try:
            return status, json.loads(data)
        except ValueError:
            return status, data

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(
    base: Path,
    *args: str,
    api_key: str | None = None,
    timeout: float = 240,
    env: dict[str, str] | None = None,
):
    """`env`: variables added to the server's (fault points)."""
    home = base / "home"  # made by the server, as a user's would be
    base.mkdir(parents=True, exist_ok=True)  # its log's folder (a caller may name a new one)
    port = free_port()
    log = base / "server.log"
    cmd = [sys.executable, "-m", "batchmlx.cli", "serve", "--port", str(port), *args]
    if api_key:
        cmd += ["--api-key", api_key]
    proc = subprocess.Popen(
        cmd, env={**cli_env(home), **(env or {})}, cwd=base, stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    server = Server(proc, port, home, log, api_key)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}:\n{log.read_text()}")
        try:
            status, _ = server.raw("GET", "/models")
            if status == 200:
                return server
        except OSError:
            pass
        time.sleep(0.2)
    server.stop()
    raise RuntimeError(f"server not ready after {timeout}s:\n{log.read_text()}")


def jsonl(lines: list[dict[str, Any] | str]) -> bytes:
    return "".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines).encode()


def wait_batch(client, batch_id: str, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {b.status} after {timeout}s")
        time.sleep(0.3)


def wait_validated(client, batch_id: str, timeout: float = 60):
    """The batch once it is no longer `validating` (the server's validator took it)."""
    deadline = time.monotonic() + timeout
    while (b := client.batches.retrieve(batch_id)).status == "validating":
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still validating after {timeout}s")
        time.sleep(0.2)
    return b
