"""TTFT of an online streamed request, alone and while a large batch runs, through the real
HTTP API (`batchmlx serve` in a subprocess, the official openai client).

    python -m benchmarks.online_ttft [--batch 64] [--trials 5] [--batch-max-tokens 48]

TTFT = time from sending the request to the first chunk that carries text. The online request
has engine priority over batch work, so a running batch should cost it little. The model cache
is $BATCHMLX_CACHE_DIR (default ~/.cache/batchmlx-test). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTION = [{"role": "user", "content": "Write one sentence about the sea."}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(home: Path, args: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, BATCHMLX_HOME=str(home))
    env.setdefault("BATCHMLX_CACHE_DIR", str(Path.home() / ".cache" / "batchmlx-test"))
    log = (home / "server.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchmlx.cli", "serve", "--port", str(port), *args],
        env=env, stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/v1"
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="unused", max_retries=0)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited:\n{(home / 'server.log').read_text()}")
        try:
            client.models.list()
            return proc, url
        except Exception:
            time.sleep(0.3)
    proc.kill()
    raise SystemExit("server did not start")


def ttft(client, max_tokens: int) -> tuple[float, float]:
    """(seconds to the first text chunk, seconds to the end) of one streamed chat request."""
    t0 = time.perf_counter()
    first = None
    for chunk in client.chat.completions.create(
        model="default", messages=QUESTION, max_tokens=max_tokens, temperature=0, stream=True
    ):
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    return first or float("nan"), time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64, help="requests in the background batch")
    ap.add_argument("--batch-max-tokens", type=int, default=48)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=8, help="of the online request")
    ap.add_argument("--max-batch-size", type=int, default=32)
    a = ap.parse_args()
    from openai import OpenAI

    with tempfile.TemporaryDirectory() as tmp:
        proc, url = _start(Path(tmp), ["--max-batch-size", str(a.max_batch_size)])
        try:
            client = OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
            ttft(client, a.max_tokens)  # warm-up: first step, prompt template
            alone = [ttft(client, a.max_tokens) for _ in range(a.trials)]

            lines = [
                {"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "gpt-4o-mini", "max_tokens": a.batch_max_tokens,
                          "messages": [{"role": "user", "content": f"Tell story number {i}."}]}}
                for i in range(a.batch)
            ]  # fmt: skip
            data = "".join(json.dumps(x) + "\n" for x in lines).encode()
            f = client.files.create(file=("bench.jsonl", data), purpose="batch")
            b = client.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            while client.batches.retrieve(b.id).status == "validating":
                time.sleep(0.1)
            time.sleep(2.0)  # let the running batch fill up
            busy = []
            for _ in range(a.trials):
                busy.append(ttft(client, a.max_tokens))
                time.sleep(0.5)
            state = client.batches.retrieve(b.id)
            done = state.request_counts.completed + state.request_counts.failed
            still = state.status == "in_progress"
            client.batches.cancel(b.id)
        finally:
            proc.terminate()
            proc.wait(60)

    def row(name: str, xs: list[tuple[float, float]]) -> str:
        firsts = [x[0] for x in xs]
        return (
            f"| {name} | {statistics.median(firsts) * 1000:.0f} | {min(firsts) * 1000:.0f} | "
            f"{max(firsts) * 1000:.0f} | {statistics.median(x[1] for x in xs) * 1000:.0f} |"
        )

    print(f"online request: chat, greedy, max_tokens={a.max_tokens}, {a.trials} trials each; "
          f"background batch: {a.batch} requests x {a.batch_max_tokens} tokens, "
          f"--max-batch-size {a.max_batch_size}")  # fmt: skip
    print("| online request | TTFT median (ms) | min | max | full response median (ms) |")
    print("|---|---|---|---|---|")
    print(row("alone", alone))
    print(row(f"while a {a.batch}-request batch runs", busy))
    print(f"(the batch had {done}/{a.batch} requests done when the last trial ended; "
          f"still running: {still})")  # fmt: skip


if __name__ == "__main__":
    main()
