"""A spawned process watched from outside: its tree's peak RSS (from /proc), sampled in a
thread, and its output lines with the moment each arrived. Used by run_peer.py's runners."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path

_SAMPLE_S = 0.2


def tree_rss(root: int) -> int:
    """Resident bytes of `root` and all its descendants, from /proc."""
    children: dict[int, list[int]] = defaultdict(list)
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            children[int(stat.rsplit(")", 1)[1].split()[1])].append(int(d))
    total, stack = 0, [root]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, ()))
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


class Watched:
    """A spawned process, its tree's peak RSS sampled in a thread, its stderr (and stdout)
    lines kept with the moment each arrived (seconds since spawn)."""

    def __init__(self, cmd: list[str], *, env: dict[str, str] | None = None,
                 cwd: Path | None = None, log_path: Path | None = None) -> None:  # fmt: skip
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace",
        )  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self.peak = 0
        self._log = open(log_path, "w") if log_path else None  # noqa: SIM115
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._read, daemon=True),
                         threading.Thread(target=self._sample, daemon=True)]  # fmt: skip
        for t in self._threads:
            t.start()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((self.now(), line.rstrip("\n")))
            if self._log:
                self._log.write(line)
        self._done.set()

    def _sample(self) -> None:
        while self.proc.poll() is None:
            self.peak = max(self.peak, tree_rss(self.proc.pid))
            time.sleep(_SAMPLE_S)

    def first(self, needle: str) -> float | None:
        return next((t for t, line in list(self.lines) if needle in line), None)

    def wait(self, timeout: float | None = None) -> float:
        """Wait for exit; the wall from spawn to exit."""
        self.proc.wait(timeout=timeout)
        wall = self.now()
        self._done.wait(5)
        if self._log:
            self._log.close()
        return wall

    def tail(self, n: int = 30) -> str:
        return "\n".join(line for _, line in self.lines[-n:])

    def stop(self) -> float:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.wait()
