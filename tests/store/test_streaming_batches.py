"""Submit and finalize stream a large batch: validated and enqueued a chunk at a time, output
and error files rendered a chunk at a time, so memory stays well below the file's size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchmlx.batches.intake import submit
from batchmlx.config import Settings
from batchmlx.core.lifecycle import BatchStatus

REPO = Path(__file__).resolve().parents[2]
LINES = 16_384
PAD = 4_000  # bytes of prompt per line: the input file and the output file are about 64 MiB each
# a phase's own peak over its start, in MiB: a file (or its rows) held whole would add 64 or more
GROWTH_MB = 24

PHASES = r"""
import asyncio, hashlib, json, sys
from pathlib import Path
from batchmlx.config import Settings
from batchmlx.core.lifecycle import RequestStatus
from batchmlx.core.records import RequestResult
from batchmlx.store import Store

def hwm_mb(key="VmHWM"):
    status = Path("/proc/self/status").read_text()
    return int(next(l for l in status.splitlines() if l.startswith(key)).split()[1]) / 1024

async def main(phase, target, home, lines, pad):
    settings = Settings(home=Path(home), cache_dir=Path(home) / "cache", database=target)
    store = await Store.from_settings(settings)
    out = {}
    # warm the store (connections, statements) before the start is read
    await store.get_batch("none")
    if phase == "submit":
        from batchmlx.batches.intake import submit
        made = hashlib.sha256()
        def chunks():  # the file, made as it is read: never whole in this process either
            for i in range(lines):
                body = {"model": "default", "max_tokens": 4, "messages": [
                    {"role": "user", "content": f"q{i} " + "x" * pad}]}
                line = json.dumps({"custom_id": f"r{i}", "method": "POST",
                                   "url": "/v1/chat/completions", "body": body}).encode() + b"\n"
                made.update(line)
                yield line
        start = hwm_mb("VmRSS")
        rec = await submit(store, settings, chunks(), filename="big.jsonl", now=1.0)
        out = {"id": rec.id, "status": rec.status.value, "total": rec.request_counts.total,
               "bytes": (await store.get_file(rec.input_file_id)).bytes, "made": made.hexdigest()}
    elif phase == "complete":  # setup, not measured: every request answered, 1 in 8 failed
        done = 0
        while claimed := await store.claim("w", 512, now=2.0, lease_s=600):
            results = []
            for c in claimed:
                if c.line % 8 == 0:
                    results.append((c.id, RequestResult(RequestStatus.FAILED, 400,
                        {"error": {"message": "bad " * 20, "type": "invalid_request_error"}})))
                else:
                    results.append((c.id, RequestResult(RequestStatus.SUCCEEDED, 200,
                        {"object": "chat.completion", "model": "SmolLM2",
                         "choices": [{"message": {"content": "y" * pad}}]},
                        prompt_tokens=9, completion_tokens=4, cache_outcome="MISS")))
            await store.complete("w", results, now=3.0)
            done += len(claimed)
        out = {"done": done}
    elif phase == "finalize":
        from batchmlx.batches.finalize import finalize
        batch_id = sys.argv[6]
        start = hwm_mb("VmRSS")
        rec = await finalize(store, settings, batch_id, now=4.0)
        out = {"status": rec.status.value}
        for key in ("output_file_id", "error_file_id"):
            f = await store.get_file(getattr(rec, key))
            reads = []
            for _ in range(2):
                h = hashlib.sha256()
                async for chunk in store.read_file(f):
                    h.update(chunk)
                reads.append(h.hexdigest())
            out[key] = {"bytes": f.bytes, "reads": reads}
    elif phase == "render":  # the files as rendered whole from every row (not measured)
        from batchmlx.formats.output import render_results
        files = render_results(sys.argv[6], await store.iter_results(sys.argv[6]))
        out = {"output": hashlib.sha256(files.output).hexdigest(),
               "errors": hashlib.sha256(files.errors).hexdigest()}
    if phase in ("submit", "finalize"):
        out["growth_mb"] = hwm_mb() - start
    await store.close()
    print(json.dumps(out))

asyncio.run(main(*sys.argv[1:4], int(sys.argv[4]), int(sys.argv[5])))
"""


def _phase(name: str, target, home: Path, *extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", PHASES, name, str(target), str(home), str(LINES), str(PAD),
         *extra],
        capture_output=True, text=True, timeout=900,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_large_batch_is_submitted_and_finalized_in_chunks(store_target, tmp_path):
    target = store_target if isinstance(store_target, str) else f"sqlite:///{store_target}"
    home = tmp_path / "home"
    sub = _phase("submit", target, home)
    assert sub["status"] == "in_progress" and sub["total"] == LINES
    assert sub["bytes"] > 64 * 1024 * 1024
    assert sub["growth_mb"] < GROWTH_MB, sub
    assert _phase("complete", target, home)["done"] == LINES
    fin = _phase("finalize", target, home, sub["id"])
    assert fin["status"] == "completed"
    assert fin["output_file_id"]["bytes"] > 56 * 1024 * 1024  # 7 lines in 8 succeeded
    assert fin["growth_mb"] < GROWTH_MB, fin
    print(f"growth: submit {sub['growth_mb']:.1f} MiB, finalize {fin['growth_mb']:.1f} MiB")
    whole = _phase("render", target, home, sub["id"])  # the same bytes as rendered whole
    assert fin["output_file_id"]["reads"] == [whole["output"]] * 2
    assert fin["error_file_id"]["reads"] == [whole["errors"]] * 2


def test_a_file_failing_on_its_last_line_enqueues_nothing(with_store, tmp_path):
    """Good lines are enqueued as they come, in the transaction that starts the batch: a bad
    line after several chunks' worth of good ones leaves no request behind."""
    settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache")
    line = (
        b'{"custom_id": "r%d", "method": "POST", "url": "/v1/chat/completions", "body": '
        b'{"model": "default", "messages": [{"role": "user", "content": "%s"}]}}\n'
    )
    good = [line % (i, b"x" * 1000) for i in range(3000)]  # about 3 MiB: several chunks
    data = b"".join(good) + b'{"custom_id": "r0", "method": "GET"}\n'

    async def scenario(store):
        rec = await submit(store, settings, data, filename="late.jsonl", now=1.0)
        assert rec.status is BatchStatus.FAILED
        assert [(e.code, e.param) for e in rec.errors] == [
            ("duplicate_custom_id", "custom_id"), ("invalid_request", "method"),
            ("missing_required_parameter", "url"), ("missing_required_parameter", "body"),
        ]  # fmt: skip
        assert {e.line for e in rec.errors} == {3001}
        assert rec.request_counts.total == 0
        assert await store.claim("w", 10, now=2.0, lease_s=60) == []

    with_store(scenario)


@pytest.mark.dialects("sqlite")
def test_more_than_100_errors_are_counted_while_streaming(with_store, tmp_path):
    settings = Settings(home=tmp_path / "home", cache_dir=tmp_path / "cache")
    data = b"not json\n" * 150_000  # about 1.3 MiB: errors found across chunks

    async def scenario(store):
        rec = await submit(store, settings, data, filename="junk.jsonl", now=1.0)
        assert rec.status is BatchStatus.FAILED
        assert len(rec.errors) == 101 and rec.errors[0].line == 1
        assert rec.errors[99].line == 100
        assert rec.errors[-1].code == "too_many_errors"
        # every bad line, and the file past 50,000 requests
        assert "... and 149,901 more errors (150,001 in all)" in rec.errors[-1].message

    with_store(scenario)
