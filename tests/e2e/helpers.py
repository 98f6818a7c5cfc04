"""End-to-end helpers: the real CLI in subprocesses against a fresh $BATCHMLX_HOME.

Converted models live in $BATCHMLX_TEST_CACHE (default ~/.cache/batchmlx-test), shared with the
engine tests, so CI converts the default model once.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"


def model_cache_dir() -> Path:
    env = os.environ.get("BATCHMLX_TEST_CACHE")
    path = Path(env).expanduser() if env else Path.home() / ".cache" / "batchmlx-test"
    path.mkdir(parents=True, exist_ok=True)
    return path


def cli_env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["BATCHMLX_HOME"] = str(home)
    env["BATCHMLX_CACHE_DIR"] = str(model_cache_dir())
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def running_site_dirs() -> list[str]:
    """The folders this Python imports installed packages from, however it was installed (the
    system's, pyenv's, a user's venv, --user): its site-packages, purelib and platlib, and the
    user site where this Python reads it."""
    dirs = [*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    found: list[str] = []
    for d in dirs:
        if d and os.path.isdir(d) and d not in found:
            found.append(d)
    return found


def venv_seeing_this_python(venv: Path) -> Path:
    """A fresh venv (its python returned) whose own site-packages comes first and which sees
    this Python's installed packages after it, as site dirs (their .pth files run), so a wheel
    installed into it `--no-deps` finds its dependencies without a download. Not
    `--system-site-packages`: inside a user's venv, the system's site-packages is not where the
    test dependencies are."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout.strip()  # fmt: skip
    lines = [f"import site; site.addsitedir({d!r})\n" for d in running_site_dirs()]
    (Path(purelib) / "_running_python_site.pth").write_text("".join(lines))
    return python


@dataclass
class Cli:
    """Runs `python -m batchmlx.cli ...` against one $BATCHMLX_HOME."""

    home: Path

    @property
    def env(self) -> dict[str, str]:
        return cli_env(self.home)

    def __call__(
        self, *args: str | Path, timeout: float = 600, cwd: Path | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "batchmlx.cli", *map(str, args)],
            env=self.env,
            cwd=cwd or self.home.parent,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def popen(self, *args: str | Path, log: Path) -> subprocess.Popen[bytes]:
        out = log.open("wb")
        return subprocess.Popen(
            [sys.executable, "-m", "batchmlx.cli", *map(str, args)],
            env=self.env,
            cwd=self.home.parent,
            stdout=out,
            stderr=subprocess.STDOUT,
        )

    def json(self, *args: str | Path, timeout: float = 600, ok: bool = True) -> Any:
        proc = self(*args, "--json", timeout=timeout)
        if ok:
            assert proc.returncode == 0, describe(proc)
        return json.loads(proc.stdout)


def describe(proc: subprocess.CompletedProcess[str]) -> str:
    return f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def watch_once(cli: Cli, inbox: Path, path: Path, log: Path) -> None:
    """`watch` takes the file into a batch (moved to done/), then stops."""
    inbox.mkdir()
    proc = cli.popen("watch", inbox, "--settle", "0.2", log=log)
    try:
        (inbox / path.name).write_bytes(path.read_bytes())
        deadline = time.monotonic() + 60
        while not (inbox / "done" / path.name).exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
    finally:
        proc.terminate()
        proc.wait(30)


def run_through_inbox(cli: Cli, base: Path, path: Path, model: str | Path, *,
                      besides: str) -> dict[str, Any]:  # fmt: skip
    """`path` dropped into a watched inbox, then run by `worker --until-idle` on `model`: the
    batch the inbox made (the one that is not `besides`)."""
    watch_once(cli, base / "inbox", path, base / "watch.log")
    worker = cli("worker", "--until-idle", "--model", model, timeout=300)
    assert worker.returncode == 0, describe(worker)
    return next(b for b in cli.json("list") if b["id"] != besides)


def make_cli(base: Path) -> Cli:
    home = base / "home"
    home.mkdir(parents=True, exist_ok=True)
    return Cli(home)


def request_line(
    custom_id: str, body: dict[str, Any], *, url: str = CHAT_URL, method: str = "POST"
) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": method, "url": url, "body": body}


def chat_body(question: str, *, model: str = "gpt-4o-mini", **params: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": "You are a concise assistant."},
            {"role": "user", "content": question},
        ],
        **params,
    }


def write_jsonl(path: Path, lines: Iterable[dict[str, Any] | str]) -> Path:
    text = "".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines)
    path.write_text(text)
    return path


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
