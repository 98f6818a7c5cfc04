"""Throughput and ETA in the CLI, and `worker --metrics-port`: real CLI processes, tiny model."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.helpers import Cli, chat_body, describe, request_line, write_jsonl
from tests.server.helpers import free_port


def batch_file(path: Path, n: int) -> Path:
    return write_jsonl(path, [request_line(f"r{i}", chat_body(f"Count to {i}.", max_tokens=12))
                              for i in range(n)])  # fmt: skip


def test_submit_wait_prints_plain_progress_with_rate_and_eta(cli: Cli, tiny_model_dir: Path):
    proc = cli("submit", batch_file(cli.home.parent / "in.jsonl", 6), "--model", tiny_model_dir,
               "--wait")  # fmt: skip
    assert proc.returncode == 0, describe(proc)
    batch_id = proc.stdout.split()[0]
    # stdout is a pipe here: plain lines on stderr, no terminal control codes
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(batch_id)]
    assert lines and "\x1b" not in proc.stderr
    assert re.fullmatch(rf"{batch_id} completed 6/6 \(100%\)  (\d[\d,]*\.\d tok/s|n/a)  ETA n/a  "
                        r"\d+s", lines[-1]), lines  # fmt: skip
    assert "throughput: " in proc.stdout

    # a batch nobody runs: no rate and no ETA to give, and the reason said instead
    queued = cli("submit", batch_file(cli.home.parent / "more.jsonl", 2), "--model", "default")
    assert queued.returncode == 0, describe(queued)
    status = cli("status", queued.stdout.split()[0])
    assert "waiting for a worker: none has taken this batch up yet" in status.stdout, status.stdout
    assert "ETA" not in status.stdout


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_worker_metrics_port(cli: Cli, tiny_model_dir: Path):
    submitted = cli.json("submit", batch_file(cli.home.parent / "in.jsonl", 5), "--model",
                         tiny_model_dir)  # fmt: skip
    port = free_port()
    log = cli.home.parent / "worker.log"
    worker = cli.popen("worker", "--model", tiny_model_dir, "--metrics-port", str(port), log=log)
    try:
        deadline = time.monotonic() + 240
        samples: dict = {}
        done = (("batchmlx_queue_requests", (("status", "succeeded"),)), 5.0)
        while time.monotonic() < deadline:
            assert worker.poll() is None, log.read_text()
            try:
                samples = scrape(port)
            except OSError:
                samples = {}
            # the queue gauges refresh on their own timer: wait for them to show the end too
            finished = samples.get(("batchmlx_batches", (("status", "completed"),))) == 1
            if (
                samples.get(done[0]) == done[1]
                and finished
                and cli.json("status", submitted["id"])["status"] == "completed"
            ):
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"metrics never showed the batch done:\n{log.read_text()}")
        samples = scrape(port)
        batch = cli.json("status", submitted["id"])
        assert samples[("batchmlx_requests_completed_total", (("source", "batch"),))] == 5
        assert samples[("batchmlx_prompt_tokens_total", ())] == batch["usage"]["input_tokens"]
        assert samples[("batchmlx_generated_tokens_total", ())] >= batch["usage"]["output_tokens"]
        outcomes = sum(v for (name, _), v in samples.items()
                       if name == "batchmlx_prefix_cache_outcomes_total")  # fmt: skip
        assert outcomes == 5
        assert samples[("batchmlx_queue_requests", (("status", "queued"),))] == 0
        assert samples[("batchmlx_batches", (("status", "completed"),))] == 1
    finally:
        worker.terminate()
        worker.wait(30)
